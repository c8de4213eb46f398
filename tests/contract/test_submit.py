"""``apply_async`` of a gated task, per store, through a broker the store cannot push to.

The broker is kombu's in-memory transport. On the SQL and Redis stores the
record is created already ``DISPATCHED`` by one statement or script, then
published (the one-write submit); on the others it is created, then written
``DISPATCHED`` (the general path). Either way no record comes back: the submit builds the
record it wrote itself. A ``task_id`` submitted again is read, and answered as
the same job or refused as a conflict; found ``DISPATCHED`` with no proof its
message left, it is published again (the gate drops a copy).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery

from celery_exactonce import ExactOnceTask, JobConflict, runtime
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import Transition
from celery_exactonce.observe import metrics
from tests.support.backends import StoreFactory


@pytest.fixture
def app(store_factory: StoreFactory) -> Iterator[Celery]:
    app = Celery("submit", broker="memory://", set_as_current=False)
    app.conf.update(
        task_default_queue=f"submit-{store_factory.namespace}",
        exactonce_store_url=store_factory.url,
        exactonce_namespace=store_factory.namespace,
    )

    @app.task(base=ExactOnceTask, shared=False, name="t.add")
    def add(x: int, y: int) -> int:
        return x + y

    metrics.COUNTERS.reset()
    try:
        yield app
    finally:
        store = runtime.runtime_for(app).store
        if store_factory.backend != "memory":
            store.drop_namespace()  # type: ignore[attr-defined]
        runtime.reset(app)
        app.close()


def test_a_submit_creates_the_job_and_dispatches_it_once(app: Celery) -> None:
    # When a gated task is submitted through a broker the store cannot push to
    result = app.tasks["t.add"].apply_async((1, 2), task_id="sub-1")
    # Then the record was created, then written DISPATCHED before the publish
    job = runtime.runtime_for(app).store.get(JobRef.submitted("sub-1"))
    assert result.id == "sub-1"
    assert job is not None and job.state is State.DISPATCHED and job.dispatches == 1
    assert [(h.src, h.dst) for h in job.history] == [
        (None, State.SCHEDULED),
        (State.SCHEDULED, State.DISPATCHED),
    ]
    assert (job.task, job.args, job.kwargs) == ("t.add", [1, 2], {})
    assert metrics.COUNTERS.get("dispatched") == 1


def test_a_task_id_submitted_again_is_the_same_job_or_a_conflict(app: Celery) -> None:
    store = runtime.runtime_for(app).store
    app.tasks["t.add"].apply_async((1, 2), task_id="sub-2")
    before = store.get(JobRef.submitted("sub-2"))
    assert before is not None and before.state is State.DISPATCHED
    # When the same task_id is submitted again with the same payload
    again = app.tasks["t.add"].apply_async((1, 2), task_id="sub-2")
    # Then the existing job stands, counted; DISPATCHED with no proof its message left,
    # it is published again, after a DISPATCHED -> DISPATCHED write of its own
    assert again.id == "sub-2"
    after = store.get(JobRef.submitted("sub-2"))
    assert after is not None and after.state is State.DISPATCHED and after.dispatches == 2
    assert after.history[: len(before.history)] == before.history
    assert (after.history[-1].src, after.history[-1].reason) == (
        State.DISPATCHED,
        "apply_async (again)",
    )
    assert (after.task, after.args, after.kwargs, after.attempt) == ("t.add", [1, 2], {}, 0)
    assert metrics.COUNTERS.get("resubmitted") == 1
    assert metrics.COUNTERS.get("dispatched") == 2
    # And with another payload it is refused, naming the task_id; nothing changes
    with pytest.raises(JobConflict, match="sub-2"):
        app.tasks["t.add"].apply_async((5, 5), task_id="sub-2")
    assert store.get(JobRef.submitted("sub-2")) == after


def test_a_task_id_submitted_again_once_its_message_arrived_is_not_published_again(
    app: Celery,
) -> None:
    store = runtime.runtime_for(app).store
    app.tasks["t.add"].apply_async((1, 2), task_id="sub-3")
    # Given the job's message reached a worker (its gate wrote RUNNING)
    job = store.get(JobRef.submitted("sub-3"))
    assert job is not None
    gate = Transition(
        State.RUNNING,
        frozenset({State.SCHEDULED, State.DISPATCHED}),
        node="worker",
        reason="gate",
        attempt=0,
        new_run_id="run-1",
    )
    assert store.transition(job.ref, gate).applied
    running = store.get(JobRef.submitted("sub-3"))
    # When the same task_id is submitted again
    app.tasks["t.add"].apply_async((1, 2), task_id="sub-3")
    # Then nothing is written or published
    assert store.get(JobRef.submitted("sub-3")) == running
    assert metrics.COUNTERS.get("resubmitted") == 1
    assert metrics.COUNTERS.get("dispatched") == 1
