"""A beat that does not import the task modules: what it decides comes from the records.

Celery beat never needs a task's code, and slim beat apps (entries only) are
common. Such a beat must not guess: whether a job is gated, and the task's own
reconciler policy, are written into the record by whoever created it (the
task's ``apply_async``, or the entry's declaration), and read from there.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import Any

import pytest
from celery import Celery

from celery_exactonce import ExactOnceTask, runtime
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.dispatch.messages import GATED_OPTION, POLICY_OPTION
from celery_exactonce.policy import task_policy
from celery_exactonce.reconcile.reconciler import Reconciler
from celery_exactonce.testing import FrozenClock, InMemoryStore
from tests.support.beat_cluster import Cluster, every, isolated, refused_at_start
from tests.support.reconciling import move

START = datetime(2026, 3, 1, 12, 0, 0, tzinfo=timezone.utc)


def gated_every(seconds: float, **exactonce: Any) -> dict[str, Any]:
    """An entry of ``t.gated``, a task this beat does not import."""
    return every(seconds, task="t.gated", exactonce={"gated": True, **exactonce})


def test_an_entry_whose_task_beat_cannot_see_is_refused_naming_it_and_the_fix() -> None:
    """SCENARIOS 67. Fails before the fix: beat started and treated the occurrences as
    plain (written ``PUBLISHED``); the workers' gate then refused every delivery, at
    DEBUG: a silent, total loss."""
    schedule = {"nightly": every(60, task="billing.charge")}
    with isolated(), refused_at_start() as refusal:
        Cluster(schedule, nodes=1, imported=False)
    message = str(refusal[0])
    assert "beat entry 'nightly'" in message and "'billing.charge'" in message
    assert "Import the task's module" in message and "'gated': True" in message
    assert refusal[0].setting == "beat_schedule"


def test_a_declared_gated_entry_is_dispatched_as_gated() -> None:
    """SCENARIOS 67: declared gated, its occurrences are left ``DISPATCHED`` for the gate."""
    with isolated():
        cluster = Cluster({"charge": gated_every(1, dispatch_deadline=7200.0)}, nodes=1)
        cluster.clock.advance(1)
        cluster.tick_all()
    job = cluster.broker.sent[0]
    stored = cluster.store.get(job.ref)
    assert stored is not None and stored.state is State.DISPATCHED
    assert stored.options[GATED_OPTION] is True
    assert stored.options[POLICY_OPTION] == {"dispatch_deadline": 7200.0}


@pytest.mark.parametrize(
    ("exactonce", "culprit"),
    [
        ({"gated": False}, "is False, but task 't.real' is an ExactOnceTask here"),
        ({"gated": "yes"}, "must be True or False"),
        ({"gated": True, "dispatch_deadline": 1.0}, "dispatch_deadline"),
        ({"gated": True, "rerun": 1}, "'rerun'] must be True or False"),
    ],
)
def test_a_wrong_declaration_is_refused_naming_the_entry(
    exactonce: dict[str, Any], culprit: str
) -> None:
    """A declaration that contradicts the task beat sees, or a bad policy value."""
    with isolated(), refused_at_start("beat entry 'e'") as refusal:
        Cluster({"e": every(60, task="t.real", exactonce=exactonce)}, nodes=1, gated=("t.real",))
    assert culprit in str(refusal[0])


def test_policy_keys_on_a_plain_entry_are_refused() -> None:
    with isolated(), refused_at_start("apply to gated tasks only"):
        Cluster({"e": every(60, exactonce={"gated": False, "rerun": True})}, nodes=1)


def test_an_entry_of_a_gated_task_beat_imports_stores_the_tasks_policy() -> None:
    with isolated():
        cluster = Cluster({"e": every(1, task="t.real")}, nodes=1, gated=("t.real",))
        cluster.clock.advance(1)
        cluster.tick_all()
    job = cluster.broker.sent[0]
    stored = cluster.store.get(job.ref)
    assert stored is not None and stored.options[GATED_OPTION] is True
    assert stored.options[POLICY_OPTION] == {"running_timeout": 1200.0, "redispatch": True}


def test_the_reconciler_of_a_slim_beat_applies_the_policy_the_record_stores() -> None:
    """Fails before the fix: a reconciler that did not import the task timed a job out at
    the 1 h default, though the task's own ``exactonce_dispatch_deadline`` was 6 h."""
    clock = FrozenClock(START)
    store = InMemoryStore("slim", clock=clock)
    # Given a client that knows the task (6 h deadline) and a job it created
    client = Celery("client", set_as_current=False)
    client.conf.update(exactonce_store_url="memory://")

    @client.task(base=ExactOnceTask, shared=False, name="t.long", exactonce_dispatch_deadline=21600)
    def long(self: Any) -> None: ...

    new = NewJob(
        JobRef.submitted(uuid.uuid4().hex),
        "t.long",
        State.SCHEDULED,
        node="client",
        options={GATED_OPTION: True, POLICY_OPTION: task_policy(client.tasks["t.long"])},
    )
    created = store.create(new)
    assert created.job is not None
    job = move(store, created.job, State.DISPATCHED)
    # When the reconciler of a beat that does not import t.long runs past the default
    slim = Celery("slim-beat", set_as_current=False)
    slim.conf.update(exactonce_store_url="memory://")
    rt = runtime.install(slim, store)
    try:
        recon = Reconciler(rt, tasks=slim.tasks)
        clock.advance(2 * 3600)
        assert recon.run_pass().ran
        # Then the job waits: its own deadline is 6 h
        current = store.get(job.ref)
        assert current is not None and current.state is State.DISPATCHED
        # and past it, the job times out
        clock.advance(4 * 3600 + 1)
        recon._retry_at.clear()
        assert recon.run_pass().ran
        current = store.get(job.ref)
        assert current is not None and current.state is State.TIMEOUT
    finally:
        runtime.reset(slim)


def test_an_adopted_job_stores_the_tasks_policy() -> None:
    """The gate, creating a record for a message from elsewhere, writes the policy too."""
    app = Celery("adopt", set_as_current=False)

    @app.task(base=ExactOnceTask, shared=False, name="t.adopt", exactonce_rerun=True)
    def adopt() -> None: ...

    assert task_policy(app.tasks["t.adopt"]) == {"rerun": True}


def test_reconciler_reads_the_tasks_attributes_for_a_record_without_a_policy() -> None:
    """Records written before the policy was stored keep the registry's attributes."""
    app = Celery("old", set_as_current=False)
    app.conf.update(exactonce_store_url="memory://")

    @app.task(base=ExactOnceTask, shared=False, name="t.old", exactonce_redispatch=True)
    def old() -> None: ...

    from celery_exactonce.policy import Timeouts

    rt = runtime.install(app, InMemoryStore("old"))
    try:
        store = rt.store
        new = NewJob(
            JobRef.submitted("o"), "t.old", State.SCHEDULED, node="n", options={GATED_OPTION: True}
        )
        job = store.create(new).job
        assert job is not None
        assert Timeouts.of(rt.config, app.tasks["t.old"], job).redispatch is True
        assert Timeouts.of(rt.config, None, job).redispatch is False
        stored = NewJob(
            JobRef.submitted("p"),
            "t.old",
            State.SCHEDULED,
            node="n",
            options={GATED_OPTION: True, POLICY_OPTION: {}},
        )
        with_policy = store.create(stored).job
        assert with_policy is not None
        assert Timeouts.of(rt.config, app.tasks["t.old"], with_policy).redispatch is False
    finally:
        runtime.reset(app)
