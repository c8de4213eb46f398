"""``celery_exactonce.core.writes``: a transition's remembered check answers as the first did;
a slot's job taken from an earlier one."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from celery_exactonce.core import exceptions
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition

AT = datetime(2026, 1, 1, tzinfo=timezone.utc)


def test_a_transition_refuses_an_edge_the_table_does_not_have_every_time() -> None:
    for _ in range(2):  # the second answer comes from the remembered check
        with pytest.raises(exceptions.InvalidRequest, match="SUCCEEDED → PENDING"):
            Transition(State.PENDING, [State.SUCCEEDED], node="n", reason="r")
    request = Transition(State.RUNNING, ["DISPATCHED"], node="n", reason="r", new_run_id="x")
    assert request.expect == frozenset({State.DISPATCHED})


def _occurrence() -> NewJob:
    return NewJob(
        JobRef.occurrence("first"),
        "t",
        State.SCHEDULED,
        node="n",
        args=[1, {"a": [2]}],
        options={"queue": "q"},
        entry="e",
        fire_time=AT,
        deadline=AT + timedelta(seconds=5),
        signature="s",
    )


def test_a_slot_job_shares_the_payload_and_takes_its_own_ref_times_and_rev() -> None:
    first = _occurrence()
    later = AT + timedelta(minutes=1)
    job = first.for_slot(JobRef.occurrence("second"), later, later + timedelta(seconds=5))
    assert (job.ref, job.fire_time, job.deadline) == (
        JobRef.occurrence("second"),
        later,
        later + timedelta(seconds=5),
    )
    assert job.rev != first.rev and job.signature is None  # the signature covered first's id
    assert job.payload_json is first.payload_json is not None
    assert (job.args, job.kwargs, job.options, job.entry) == (
        first.args,
        first.kwargs,
        first.options,
        "e",
    )
    assert first.ref == JobRef.occurrence("first") and first.fire_time == AT  # unchanged


def test_a_slot_job_is_refused_for_a_submitted_job_or_a_naive_time() -> None:
    with pytest.raises(exceptions.InvalidRequest, match="only an occurrence"):
        _occurrence().for_slot(JobRef.submitted("x"), AT, None)
    submitted = NewJob(JobRef.submitted("x"), "t", State.SCHEDULED, node="n")
    with pytest.raises(exceptions.InvalidRequest, match="only an occurrence"):
        submitted.for_slot(JobRef.occurrence("y"), AT, None)
    with pytest.raises(exceptions.InvalidPayload, match="fire_time"):
        _occurrence().for_slot(JobRef.occurrence("y"), AT.replace(tzinfo=None), None)
