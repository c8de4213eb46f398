"""Celery's own semantics kept by ``ExactOnceTask``, in process (the real worker: test_compat).

Submissions go through the real dispatch path to an in-memory broker; the
messages are read back from ``before_task_publish``. Deliveries are handed to
the gate as Celery's worker does (a request pushed, then the task called).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore, Reject, TaskRevokedError

from celery_exactonce import JobConflict, runtime
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.dispatch.messages import (
    MESSAGE_ID_OPTION,
    message_headers,
    replacement_job_id,
)
from celery_exactonce.observe import metrics
from celery_exactonce.task.base import ExactOnceTask
from celery_exactonce.task.heartbeats import heartbeats
from celery_exactonce.testing import FrozenClock, InMemoryStore
from tests.acceptance.harness import holds
from tests.support.helpers import poll
from tests.support.publishing import publishing

NAMESPACE = "semantics-unit"

try:
    import pydantic
except ImportError:  # pragma: no cover - a dev dependency
    pydantic = None  # type: ignore[assignment]
else:

    class Point(pydantic.BaseModel):
        """A model argument of a ``pydantic=True`` task."""

        x: int


@dataclass
class World:
    app: Celery
    store: InMemoryStore
    clock: FrozenClock
    #: Every message published: (task_id, headers, body).
    sent: list[tuple[str, dict[str, Any], Any]] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)

    def job(self, job_id: str) -> Job:
        job = self.store.get(JobRef.submitted(job_id))
        assert job is not None, f"no job {job_id}"
        return job

    def deliver(self, name: str, job: Job) -> str:
        """Hand the gate the message of ``job``; what became of it."""
        task = self.app.tasks[name]
        headers = message_headers(job, NAMESPACE)
        task.push_request(
            id=str(job.options.get(MESSAGE_ID_OPTION) or job.ref.id),
            args=job.args,
            kwargs={},
            retries=job.attempt,
            headers=headers,
            is_eager=False,
            called_directly=False,
            delivery_info={"redelivered": False},
            **headers,
        )
        try:
            task(*job.args)
        except Ignore:
            return "ignored"
        except Reject:
            return "rejected"
        finally:
            task.pop_request()
        return "ran"


@pytest.fixture
def world() -> Iterator[World]:
    app = Celery(
        "semantics-unit", broker="memory://", backend="cache+memory://", set_as_current=False
    )
    app.conf.update(exactonce_store_url="memory://", exactonce_namespace=NAMESPACE)
    clock = FrozenClock(datetime.now(timezone.utc))
    store = InMemoryStore(NAMESPACE, clock=clock)
    runtime.install(app, store)
    world = World(app, store, clock)

    @app.task(base=ExactOnceTask, shared=False, name="t.add")
    def add(x: int, y: int) -> int:
        world.runs.append("add")
        return x + y

    @app.task(base=ExactOnceTask, shared=False, name="t.limits", soft_time_limit=5, time_limit=2)
    def limits() -> None:
        world.runs.append("limits")

    @app.task(base=ExactOnceTask, shared=False, name="t.quiet", ignore_result=True)
    def quiet() -> None:
        world.runs.append("quiet")

    @app.task(base=ExactOnceTask, shared=False, bind=True, name="t.requeue", acks_late=True)
    def requeue(self: Any, x: int) -> None:
        world.runs.append("requeue")
        raise Reject("again", requeue=True)

    @app.task(base=ExactOnceTask, shared=False, bind=True, name="t.requeue_early")
    def requeue_early(self: Any, x: int) -> None:
        world.runs.append("requeue_early")
        raise Reject("again", requeue=True)

    @app.task(base=ExactOnceTask, shared=False, bind=True, name="t.replacing")
    def replacing(self: Any, x: int) -> None:
        world.runs.append("replacing")
        raise self.replace(add.s(x, 100))

    @app.task(base=ExactOnceTask, shared=False, bind=True, name="t.parent")
    def parent(self: Any, x: int) -> str:
        world.runs.append("parent")
        child: str = add.delay(x, 1).id
        return child

    def capture(sender: Any = None, headers: Any = None, body: Any = None, **_kw: Any) -> None:
        world.sent.append((headers["id"], dict(headers), body))

    with publishing(app, capture):
        yield world


def test_time_limits_the_wrong_way_round_raise_before_anything_is_stored(world: World) -> None:
    task_id = uuid.uuid4().hex
    with pytest.raises(ValueError, match="soft_time_limit"):
        world.app.tasks["t.limits"].apply_async(task_id=task_id)
    assert world.store.get(JobRef.submitted(task_id)) is None and not world.sent


def test_wrong_arguments_raise_type_error_before_anything_is_stored(world: World) -> None:
    task_id = uuid.uuid4().hex
    with pytest.raises(TypeError):
        world.app.tasks["t.add"].apply_async((5,), task_id=task_id)
    assert world.store.get(JobRef.submitted(task_id)) is None and not world.sent


def test_pydantic_models_are_dumped_as_celery_dumps_them(world: World) -> None:
    if pydantic is None:
        pytest.skip("pydantic is not installed")

    @world.app.task(base=ExactOnceTask, shared=False, name="t.typed", pydantic=True)
    def typed(point: Point) -> int:
        return point.x

    result = typed.delay(Point(x=3))
    assert world.job(result.id).args == [{"x": 3}]


@pytest.mark.parametrize("how", ["task attribute", "option"])
def test_an_ignored_result_is_marked_ignored(world: World, how: str) -> None:
    if how == "task attribute":
        result = world.app.tasks["t.quiet"].delay()
    else:
        result = world.app.tasks["t.add"].apply_async((1, 2), ignore_result=True)
    assert result.ignored is True
    assert world.sent[-1][1]["ignore_result"] is True
    assert world.app.tasks["t.add"].delay(1, 2).ignored is False


def test_a_delayed_submission_is_marked_ignored_too(world: World) -> None:
    result = world.app.tasks["t.quiet"].apply_async(countdown=60)
    assert result.ignored is True and not world.sent
    assert world.job(result.id).state is State.PENDING


def test_the_result_returned_is_the_class_asked_for(world: World) -> None:
    class Mine(world.app.AsyncResult):  # type: ignore[name-defined,misc]
        pass

    result = world.app.tasks["t.add"].apply_async((1, 2), result_cls=Mine)
    assert type(result) is Mine and world.sent


def test_a_resubmitted_task_id_returns_the_job_and_is_counted(world: World) -> None:
    add = world.app.tasks["t.add"]
    task_id = uuid.uuid4().hex
    add.apply_async((1, 2), task_id=task_id)
    first = world.job(task_id)
    # Found DISPATCHED, with no proof its message left: published again (the gate
    # drops the copy if the first one landed)
    add.apply_async((1, 2), task_id=task_id)
    assert len(world.sent) == 2
    assert metrics.COUNTERS.get("resubmitted") == 1
    assert world.deliver("t.add", first) == "ran"
    assert world.deliver("t.add", world.job(task_id)) == "ignored"
    # Once a delivery passed the gate, a resubmission publishes nothing
    add.apply_async((1, 2), task_id=task_id)
    assert len(world.sent) == 2
    assert metrics.COUNTERS.get("resubmitted") == 2


def test_a_task_id_reused_in_another_canvas_is_a_conflict(world: World) -> None:
    add = world.app.tasks["t.add"]
    task_id = uuid.uuid4().hex
    add.apply_async((1, 2), task_id=task_id, group_id="g1")
    with pytest.raises(JobConflict, match="group_id differs"):
        add.apply_async((1, 2), task_id=task_id, group_id="g2")
    assert len(world.sent) == 1


def test_a_requeue_is_the_next_attempt_published_once(world: World) -> None:
    result = world.app.tasks["t.requeue"].delay(1)
    assert world.deliver("t.requeue", world.job(result.id)) == "ignored"  # acked
    job = world.job(result.id)
    assert (job.state, job.attempt) == (State.DISPATCHED, 1)
    assert [(h["id"], h["retries"]) for _, h, _ in world.sent] == [
        (result.id, 0),
        (result.id, 1),
    ]
    # The message of the attempt that ran, delivered again, does not run.
    first = world.job(result.id)
    stale = type(first)(**{**first.__dict__, "attempt": 0})
    assert world.deliver("t.requeue", stale) == "ignored"
    assert world.runs == ["requeue"]


def test_a_requeue_without_acks_late_fails_the_job_as_celery_drops_it(world: World) -> None:
    result = world.app.tasks["t.requeue_early"].delay(1)
    assert world.deliver("t.requeue_early", world.job(result.id)) == "rejected"
    assert world.job(result.id).state is State.FAILED and len(world.sent) == 1


def test_a_replacement_is_a_job_of_its_own_with_the_replaced_id(world: World) -> None:
    result = world.app.tasks["t.replacing"].delay(1)
    assert world.deliver("t.replacing", world.job(result.id)) == "ignored"
    replacement = world.job(replacement_job_id(result.id, 1))
    assert (replacement.task, replacement.args) == ("t.add", [1, 100])
    replaced = world.job(result.id)
    assert replaced.state is State.SUCCEEDED and str(replacement.ref) in replaced.reason
    task_id, headers, _ = world.sent[-1]
    assert task_id == result.id and headers["exactonce_job_id"] == replacement.ref.id
    assert headers["replaced_task_nesting"] == 1
    assert world.deliver("t.add", replacement) == "ran"
    assert world.job(replacement.ref.id).state is State.SUCCEEDED
    # The replaced message delivered again: the gate refuses it, nothing is submitted.
    sent = len(world.sent)
    assert world.deliver("t.replacing", world.job(result.id)) == "ignored"
    assert len(world.sent) == sent and world.runs == ["replacing", "add"]


def test_a_job_that_waited_in_the_store_is_published_with_its_eta(world: World) -> None:
    eta = datetime.now(timezone.utc) + timedelta(seconds=30)
    result = world.app.tasks["t.add"].apply_async((1, 2), eta=eta)
    assert not world.sent
    world.clock.set(eta + timedelta(seconds=1))
    (claimed,) = world.store.claim_due(limit=1, node="n")
    runtime.runtime_for(world.app).dispatcher.dispatch(claimed)
    task_id, headers, _ = world.sent[-1]
    assert task_id == result.id
    assert datetime.fromisoformat(headers["eta"]) == eta


def test_a_body_that_submits_another_task_submits_it_and_ends_as_itself(world: World) -> None:
    result = world.app.tasks["t.parent"].delay(1)
    assert world.deliver("t.parent", world.job(result.id)) == "ran"
    parent = world.job(result.id)
    assert (parent.state, parent.attempt, parent.args) == (State.SUCCEEDED, 0, [1])
    (child_id,) = [task_id for task_id, headers, _ in world.sent if headers["task"] == "t.add"]
    child = world.job(child_id)
    assert (child.args, child.state) == ([1, 1], State.DISPATCHED)


def test_a_job_expired_before_its_publish_is_revoked_as_a_worker_would_say(world: World) -> None:
    result = world.app.tasks["t.add"].apply_async((1, 2), expires=-1)
    assert world.job(result.id).state is State.CANCELLED and not world.sent
    assert result.state == "REVOKED"
    with pytest.raises(TaskRevokedError, match="expired"):
        result.get(timeout=1)


class _CountingStore(InMemoryStore):
    """Counts the heartbeats it is sent, per job."""

    def __init__(self, namespace: str) -> None:
        super().__init__(namespace)
        self.beats: dict[str, int] = {}

    def heartbeat(self, ref: JobRef, run_id: str) -> bool:
        self.beats[ref.id] = self.beats.get(ref.id, 0) + 1
        return super().heartbeat(ref, run_id)


def test_one_heartbeat_thread_touches_each_running_job_until_it_ends() -> None:
    app = Celery("heartbeats-unit", broker="memory://", set_as_current=False)
    app.conf.update(
        exactonce_store_url="memory://",
        exactonce_namespace=NAMESPACE,
        exactonce_heartbeat_interval=0.02,
    )
    store = _CountingStore(NAMESPACE)
    rt = runtime.install(app, store)
    try:
        long_run, short_run = JobRef.submitted("long"), JobRef.submitted("short")
        for ref, run_id in ((long_run, "r1"), (short_run, "r2")):
            store.create(NewJob(ref, "t.add", State.RUNNING, node="n", run_id=run_id))
        beating = heartbeats.start(rt, long_run, "r1")
        heartbeats.stop(heartbeats.start(rt, short_run, "r2"))  # a body shorter than a beat
        poll(lambda: store.beats.get("long", 0) >= 3, timeout=5.0)
        heartbeats.stop(beating)
        stopped = store.beats["long"]
        holds(lambda: store.beats["long"] <= stopped + 1, seconds=0.2)  # one may be in flight
        assert "short" not in store.beats
    finally:
        runtime.reset(app)
