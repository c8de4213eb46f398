"""``celery_exactonce.core.jobs``: the shortcuts a write takes give what the long way gives."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone

import pytest

from celery_exactonce.core import jobs
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition

NOW = datetime(2026, 11, 24, 12, 0, tzinfo=timezone.utc)


def _job() -> jobs.Job:
    new = NewJob(
        JobRef.submitted("j1"), "t.add", State.SCHEDULED, node="n", args=[1], kwargs={"k": 2}
    )
    return jobs.job_from_new(new, NOW)


def test_a_transition_applied_is_the_record_dataclasses_replace_builds() -> None:
    job = _job()
    request = Transition(State.DISPATCHED, [State.SCHEDULED], node="m", reason="r", rev=job.rev)
    applied = jobs.apply_transition(job, request, NOW)
    expected = dataclasses.replace(
        job,
        state=State.DISPATCHED,
        rev=request.new_rev,
        dispatches=1,
        node="m",
        reason="r",
        history=(
            *job.history,
            jobs.HistoryEntry(State.SCHEDULED, State.DISPATCHED, NOW, "m", "r", request.new_rev),
        ),
    )
    assert applied == expected
    assert job.state is State.SCHEDULED  # the record applied to is left as it was
    with pytest.raises(dataclasses.FrozenInstanceError):
        applied.state = State.RUNNING  # type: ignore[misc]


def test_a_copy_naming_no_field_of_a_job_is_refused() -> None:
    with pytest.raises(TypeError, match="no field 'nope'"):
        jobs._replaced(_job(), nope=1)


@pytest.mark.parametrize("deadline", [None, datetime(2026, 11, 25, tzinfo=timezone.utc)])
def test_an_enqueued_job_built_in_one_step_is_the_record_create_then_dispatch_builds(
    deadline: datetime | None,
) -> None:
    new = NewJob(
        JobRef.submitted("j2"),
        "t.add",
        State.SCHEDULED,
        node="n",
        args=[1],
        kwargs={"k": 2},
        options={"queue": "q"},
        deadline=deadline,
        reason="apply_async",
    )
    request = Transition(State.DISPATCHED, [State.SCHEDULED], node="m", reason="r", rev=new.rev)
    long_way = jobs.apply_transition(jobs.job_from_new(new, NOW), request, NOW)
    built = jobs.enqueued_job(new, request, NOW)
    assert built == long_way
    assert built.args is not new.args and built.options is not new.options  # its own copies
