"""A gated task run in the caller's process: eager mode, ``apply()`` and direct calls.

``self.request.idempotency_key`` is set in each, deterministically (it raised
``AttributeError`` before: issue 16). With the app's store in memory, an eager
run goes through the store as a worker's would; any other store is never
opened (celery_exactonce/task/eager.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, states

from celery_exactonce import JobConflict, runtime
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.dispatch.messages import (
    HEADER_IDEMPOTENCY_KEY,
    POLICY_OPTION,
    message_headers,
    submitted_key,
)
from celery_exactonce.task.base import ExactOnceTask
from celery_exactonce.task.eager import direct_key
from celery_exactonce.testing import InMemoryStore

NAMESPACE = "eager-unit"
#: Nothing listens here: a store that would need this server must never be opened.
UNREACHABLE = "redis://127.0.0.1:9/0"

#: (task name, idempotency key, retries) of every body run.
RUNS: list[tuple[str, str, int]] = []


def make_app(**settings: Any) -> Celery:
    app = Celery("eager-unit", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.update(task_always_eager=True, task_eager_propagates=True, **settings)

    @app.task(base=ExactOnceTask, shared=False, bind=True, name="t.key", max_retries=3)
    def key(self: Any, retries: int = 0) -> str:
        RUNS.append((self.name, self.request.idempotency_key, self.request.retries))
        if self.request.retries < retries:
            raise self.retry(countdown=60)
        return str(self.request.idempotency_key)

    @app.task(base=ExactOnceTask, shared=False, bind=True, name="t.boom")
    def boom(self: Any) -> None:
        RUNS.append((self.name, self.request.idempotency_key, self.request.retries))
        raise ValueError("boom")

    @app.task(base=ExactOnceTask, shared=False, bind=True, name="t.outer")
    def outer(self: Any) -> str:
        RUNS.append((self.name, self.request.idempotency_key, self.request.retries))
        inner = self.app.tasks["t.key"].apply_async(task_id=f"{self.request.id}-inner")
        return str(inner.get(disable_sync_subtasks=False))

    return app


@pytest.fixture(autouse=True)
def _runs() -> Iterator[None]:
    RUNS.clear()
    yield
    RUNS.clear()


@pytest.fixture
def bare() -> Iterator[Celery]:
    """An app whose store needs a server that is not there, in eager mode."""
    app = make_app(exactonce_store_url=UNREACHABLE, exactonce_namespace=NAMESPACE)
    yield app
    runtime.reset(app)


@pytest.fixture
def stored() -> Iterator[tuple[Celery, InMemoryStore]]:
    """An app in eager mode whose store is in memory (installed, as the plugin does)."""
    app = make_app(exactonce_store_url="memory://", exactonce_namespace=NAMESPACE)
    store = InMemoryStore(NAMESPACE)
    runtime.install(app, store)
    yield app, store
    runtime.reset(app)


def ran() -> list[tuple[str, str, int]]:
    """Every body run so far: (task name, idempotency key, retries)."""
    return list(RUNS)


def job_of(store: InMemoryStore, job_id: str) -> Job:
    job = store.get(JobRef.submitted(job_id))
    assert job is not None, f"no job {job_id}"
    return job


# -- the key, with no store in this process ------------------------------------------------


def test_no_setting_at_all_eager_and_direct_calls_carry_a_key() -> None:
    app = make_app()  # no exactonce_* setting: the namespace is "default"
    task = app.tasks["t.key"]
    assert task.delay().get().startswith("eo1_")
    assert task.apply(task_id="a").get() == submitted_key("a", "default")
    assert task() == task.run() == direct_key(app, "t.key")
    assert runtime.installed(app) is None


@pytest.mark.parametrize("how", ["delay", "apply_async", "apply"])
def test_an_eager_run_has_the_key_a_worker_would_see_for_that_task_id(
    bare: Celery, how: str
) -> None:
    task = bare.tasks["t.key"]
    task_id = f"fixed-{how}"
    result = {
        "delay": lambda: task.apply_async(task_id=task_id),  # delay takes no task_id
        "apply_async": lambda: task.apply_async((), task_id=task_id, countdown=30),
        "apply": lambda: task.apply(task_id=task_id),
    }[how]()
    worker_would_see = submitted_key(task_id, NAMESPACE)
    assert result.get() == worker_would_see
    assert ran() == [("t.key", worker_would_see, 0)]


def test_a_random_task_id_gives_each_eager_run_its_own_key(bare: Celery) -> None:
    task = bare.tasks["t.key"]
    first, second = task.delay(), task.delay()
    assert first.get() == submitted_key(first.id, NAMESPACE)
    assert second.get() == submitted_key(second.id, NAMESPACE)
    assert first.get() != second.get()


def test_eager_mode_never_opens_a_store_that_is_not_in_memory(bare: Celery) -> None:
    bare.tasks["t.key"].delay().get()
    bare.tasks["t.key"].apply().get()
    assert runtime.installed(bare) is None  # no runtime built, so no store opened
    assert len(RUNS) == 2


def test_a_direct_call_carries_the_tasks_direct_key_the_same_each_call(bare: Celery) -> None:
    task = bare.tasks["t.key"]
    expected = direct_key(bare, "t.key")
    assert expected.startswith("eo1_") and expected != submitted_key("t.key", NAMESPACE)
    assert task() == task() == expected
    assert task.run() == expected  # no request pushed: Celery's default one, with the key
    assert direct_key(bare, "t.key") != direct_key(make_app(), "t.key")  # the namespace counts


def test_the_direct_key_outside_a_call_never_leaks_into_a_later_request(bare: Celery) -> None:
    task = bare.tasks["t.key"]
    assert task.run() == direct_key(bare, "t.key")
    task.push_request(id="worker-delivery")  # as Celery's tracer pushes a delivery's request
    try:
        assert "idempotency_key" not in vars(task.request)
    finally:
        task.pop_request()
    assert task.apply(task_id="later").get() == submitted_key("later", NAMESPACE)


def test_a_direct_call_pushes_a_request_as_celery_does(bare: Celery) -> None:
    seen: list[Any] = []

    @bare.task(base=ExactOnceTask, shared=False, bind=True, name="t.args")
    def args(self: Any, x: int, y: int = 0) -> None:
        seen.append((self.request.args, self.request.kwargs, self.request.called_directly))

    args(1, y=2)
    assert seen == [((1,), {"y": 2}, True)]
    assert args.request_stack.top is None  # popped


# -- eager mode with the store in memory ---------------------------------------------------


def test_an_eager_run_is_recorded_as_a_worker_run_would_be(
    stored: tuple[Celery, InMemoryStore],
) -> None:
    app, store = stored
    result = app.tasks["t.key"].apply_async(task_id="job-1")
    job = job_of(store, "job-1")
    assert result.state == states.SUCCESS
    assert result.get() == message_headers(job, NAMESPACE)[HEADER_IDEMPOTENCY_KEY]
    assert job.state is State.SUCCEEDED
    assert [(h.src, h.dst) for h in job.history] == [
        (None, State.SCHEDULED),
        (State.SCHEDULED, State.DISPATCHED),
        (State.DISPATCHED, State.RUNNING),
        (State.RUNNING, State.SUCCEEDED),
    ]


def test_a_task_id_submitted_again_eagerly_is_the_same_job_not_run_again(
    stored: tuple[Celery, InMemoryStore],
) -> None:
    app, store = stored
    task = app.tasks["t.key"]
    first = task.apply_async(task_id="once")
    again = task.apply_async(task_id="once")
    assert (first.state, again.state) == (states.SUCCESS, states.IGNORED)
    assert again.get() is None
    assert len(RUNS) == 1
    assert job_of(store, "once").state is State.SUCCEEDED
    with pytest.raises(JobConflict):
        task.apply_async((1,), task_id="once")  # another payload under that id
    assert len(RUNS) == 1


def test_eager_runs_at_once_whatever_the_eta_as_celery_does(
    stored: tuple[Celery, InMemoryStore],
) -> None:
    app, store = stored
    app.tasks["t.key"].apply_async(task_id="later", countdown=3600)
    assert len(RUNS) == 1
    job = job_of(store, "later")
    assert job.state is State.SUCCEEDED and job.run_at is None
    assert job.history[0].reason == "apply_async (eager)"


def test_a_failing_eager_body_ends_its_job_failed_and_raises(
    stored: tuple[Celery, InMemoryStore],
) -> None:
    app, store = stored
    with pytest.raises(ValueError, match="boom"):
        app.tasks["t.boom"].apply_async(task_id="bad")
    job = job_of(store, "bad")
    assert job.state is State.FAILED
    assert job.reason == "ValueError: boom"


def test_an_eager_retry_is_the_next_attempt_of_the_same_job(
    stored: tuple[Celery, InMemoryStore],
) -> None:
    app, store = stored
    app.conf.task_eager_propagates = False  # with it, Celery raises the Retry instead
    result = app.tasks["t.key"].apply_async((2,), task_id="flaky")
    key = submitted_key("flaky", NAMESPACE)
    assert result.get() == key
    assert ran() == [("t.key", key, 0), ("t.key", key, 1), ("t.key", key, 2)]
    job = job_of(store, "flaky")
    assert (job.state, job.attempt) == (State.SUCCEEDED, 2)
    assert [h.dst for h in job.history].count(State.RUNNING) == 3


def test_apply_without_eager_mode_adopts_the_run_and_refuses_it_twice(
    stored: tuple[Celery, InMemoryStore],
) -> None:
    app, store = stored
    app.conf.task_always_eager = False
    task = app.tasks["t.key"]
    assert task.apply(task_id="adopted").get() == submitted_key("adopted", NAMESPACE)
    assert task.apply(task_id="adopted").state == states.IGNORED
    assert len(RUNS) == 1
    job = job_of(store, "adopted")
    assert job.state is State.SUCCEEDED and job.history[0].reason == "adopted at the gate"


def test_a_run_adopted_at_the_gate_stores_its_tasks_policy(
    stored: tuple[Celery, InMemoryStore],
) -> None:
    app, store = stored

    @app.task(base=ExactOnceTask, shared=False, name="t.tuned", exactonce_redispatch=True)
    def tuned() -> None:
        """A task that opts in to redispatch."""

    app.conf.task_always_eager = False
    tuned.apply(task_id="tuned")
    assert job_of(store, "tuned").options[POLICY_OPTION] == {"redispatch": True}


def test_an_eager_body_that_submits_another_task_records_both(
    stored: tuple[Celery, InMemoryStore],
) -> None:
    app, store = stored
    outer = app.tasks["t.outer"].apply_async(task_id="outer")
    assert outer.get() == submitted_key("outer-inner", NAMESPACE)
    assert job_of(store, "outer").state is State.SUCCEEDED
    assert job_of(store, "outer-inner").state is State.SUCCEEDED


def test_a_direct_call_never_touches_the_store(stored: tuple[Celery, InMemoryStore]) -> None:
    app, store = stored
    assert app.tasks["t.key"]() == direct_key(app, "t.key")
    assert store.list_stale(State.SUCCEEDED, -86_400.0, 10) == []
    assert store.list_stale(State.RUNNING, -86_400.0, 10) == []


def test_a_memory_url_is_used_by_eager_runs_without_installing_anything() -> None:
    app = make_app(exactonce_store_url="memory://", exactonce_namespace=NAMESPACE)
    try:
        task_id = uuid.uuid4().hex
        app.tasks["t.key"].apply_async(task_id=task_id)
        built = runtime.installed(app)
        assert built is not None
        job = built.store.get(JobRef.submitted(task_id))
        assert job is not None and job.state is State.SUCCEEDED
    finally:
        runtime.reset(app)
