"""``apply_async`` of a gated task on the general path, per store.

The broker is one the store cannot push to (kombu's in-memory transport).

The create is brief (no record comes back): the submit builds the record it
created itself and dispatches it; a ``task_id`` submitted again is read, and
answered as the same job or refused as a conflict.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery

from celery_exactonce import ExactOnceTask, JobConflict, runtime
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
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
    # When the same task_id is submitted again with the same payload
    again = app.tasks["t.add"].apply_async((1, 2), task_id="sub-2")
    # Then the existing job stands (read back from the store), counted, not dispatched again
    assert again.id == "sub-2"
    assert store.get(JobRef.submitted("sub-2")) == before
    assert metrics.COUNTERS.get("resubmitted") == 1
    assert metrics.COUNTERS.get("dispatched") == 1
    # And with another payload it is refused, naming the task_id; nothing changes
    with pytest.raises(JobConflict, match="sub-2"):
        app.tasks["t.add"].apply_async((5, 5), task_id="sub-2")
    assert store.get(JobRef.submitted("sub-2")) == before
