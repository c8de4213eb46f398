"""``cancel()`` (``reconcile/cancel.py``): a job not dispatched yet ends CANCELLED, never runs.

A delayed job waiting ``PENDING`` or a job ``SCHEDULED`` and not yet published
is cancelled; a job dispatched, running or finished is left as it is. A write
whose answer is lost is read back; one the store refused raises, and calling
again is safe. Jobs live in an InMemoryStore on a frozen clock (the sweep's
``claim_due`` runs on it); what is published is read from ``before_task_publish``.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import celery._state
import pytest
from celery import Celery

from celery_exactonce import ExactOnceTask, StoreError, StoreUnavailable, cancel, runtime
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.dispatch.messages import GATED_OPTION
from celery_exactonce.testing import FrozenClock, InMemoryStore
from tests.support.publishing import publishing

NAMESPACE = "control-unit"


class ScriptedStore(InMemoryStore):
    """An in-memory store whose next transitions and reads fail as scripted.

    ``transitions``: per call, ``"ok"``, ``"fail"`` (refused before applying) or
    ``"lose"`` (applied, then the answer is lost); ``gets``: ``"ok"`` or ``"fail"``.
    """

    def __init__(self, namespace: str, clock: FrozenClock) -> None:
        super().__init__(namespace, clock=clock)
        self.transitions: list[str] = []
        self.gets: list[str] = []

    def transition(self, ref, request):  # type: ignore[no-untyped-def]
        step = self.transitions.pop(0) if self.transitions else "ok"
        if step == "fail":
            raise StoreUnavailable("injected: refused")
        result = super().transition(ref, request)
        if step == "lose":
            raise StoreUnavailable("injected: applied, answer lost")
        return result

    def get(self, ref):  # type: ignore[no-untyped-def]
        if self.gets and self.gets.pop(0) == "fail":
            raise StoreUnavailable("injected: read failed")
        return super().get(ref)


@dataclass
class World:
    app: Celery
    store: ScriptedStore
    clock: FrozenClock
    #: The task id of every message published.
    sent: list[str] = field(default_factory=list)

    def job(self, job_id: str) -> Job:
        job = self.store.get(JobRef.submitted(job_id))
        assert job is not None, f"no job {job_id}"
        return job

    def put(self, state: State) -> Job:
        """A job of ``t.add`` brought to ``state`` as the dispatch path and the gate would."""
        job_id = uuid.uuid4().hex
        created = self.store.create(
            NewJob(
                JobRef.submitted(job_id),
                "t.add",
                State.SCHEDULED,
                node="n",
                args=[1, 2],
                options={GATED_OPTION: True},
            )
        )
        assert created.job is not None
        job = created.job
        path = {
            State.SCHEDULED: [],
            State.DISPATCHED: [State.DISPATCHED],
            State.RUNNING: [State.DISPATCHED, State.RUNNING],
            State.SUCCEEDED: [State.DISPATCHED, State.RUNNING, State.SUCCEEDED],
            State.TIMEOUT: [State.DISPATCHED, State.TIMEOUT],
            State.CANCELLED: [State.CANCELLED],
        }[state]
        for to in path:
            guards: dict[str, Any] = {"rev": job.rev}
            if to is State.RUNNING:
                guards = {"new_run_id": "run-1"}
            elif job.state is State.RUNNING:
                guards = {"run_id": job.run_id}
            request = Transition(to, frozenset({job.state}), node="n", reason="test", **guards)
            result = self.store.transition(job.ref, request)
            assert result.applied and result.job is not None
            job = result.job
        return job


@pytest.fixture
def world() -> Iterator[World]:
    app = Celery("control-unit", broker="memory://", set_as_current=False)
    app.conf.update(exactonce_store_url="memory://", exactonce_namespace=NAMESPACE)
    clock = FrozenClock(datetime.now(timezone.utc))
    store = ScriptedStore(NAMESPACE, clock)
    runtime.install(app, store)
    world = World(app, store, clock)

    @app.task(base=ExactOnceTask, shared=False, name="t.add")
    def add(x: int, y: int) -> int:
        return x + y

    def capture(sender: Any = None, headers: Any = None, **_kw: Any) -> None:
        world.sent.append(headers["id"])

    with publishing(app, capture):
        yield world


def delayed(world: World, seconds: float = 60.0) -> str:
    """Submit a ``t.add`` job due ``seconds`` from now: it waits PENDING in the store."""
    result = world.app.tasks["t.add"].apply_async((1, 2), countdown=seconds)
    assert world.job(result.id).state is State.PENDING and result.id not in world.sent
    return str(result.id)


def test_a_delayed_job_is_cancelled_and_never_claimed(world: World) -> None:
    task_id = delayed(world)
    # When it is cancelled before its run_at
    assert cancel(task_id, app=world.app) is True
    # Then it is CANCELLED, by this node, with the reason
    job = world.job(task_id)
    assert job.state is State.CANCELLED and job.reason == "cancelled by cancel()"
    assert job.history[-1].node == runtime.runtime_for(world.app).node
    # and once it falls due, the sweep does not claim it: it is never published
    world.clock.advance(3600)
    assert world.store.claim_due(limit=10, node="beat") == []
    assert world.sent == []


def test_a_scheduled_job_not_yet_published_is_cancelled_and_its_dispatch_sends_nothing(
    world: World,
) -> None:
    # Given a job a beat node claimed and listed, not yet published
    listed = world.put(State.SCHEDULED)
    # When it is cancelled before the publish
    assert cancel(listed.ref.id, app=world.app) is True
    # Then the dispatch of what was listed loses its CAS and publishes nothing
    runtime.runtime_for(world.app).dispatcher.dispatch(listed, retry=False)
    assert world.sent == []
    assert world.job(listed.ref.id).state is State.CANCELLED


@pytest.mark.parametrize(
    "state",
    [State.DISPATCHED, State.RUNNING, State.SUCCEEDED, State.TIMEOUT, State.CANCELLED],
)
def test_a_job_dispatched_running_or_finished_is_left_as_it_is(world: World, state: State) -> None:
    job = world.put(state)
    assert cancel(job.ref.id, app=world.app) is False
    assert world.job(job.ref.id) == job


def test_an_unknown_task_id_is_not_cancelled_and_no_record_is_made(world: World) -> None:
    assert cancel("never-submitted", app=world.app) is False
    assert world.store.get(JobRef.submitted("never-submitted")) is None


def test_a_second_cancel_answers_false_and_writes_nothing(world: World) -> None:
    task_id = delayed(world)
    assert cancel(task_id, app=world.app) is True
    first = world.job(task_id)
    assert cancel(task_id, app=world.app) is False
    assert world.job(task_id) == first
    assert [h.dst for h in first.history].count(State.CANCELLED) == 1


def test_a_cancel_whose_answer_was_lost_is_read_back_as_done(world: World) -> None:
    task_id = delayed(world)
    world.store.transitions = ["lose"]
    assert cancel(task_id, app=world.app) is True
    assert world.job(task_id).state is State.CANCELLED


def test_a_cancel_the_store_refused_raises_and_calling_again_cancels(world: World) -> None:
    task_id = delayed(world)
    world.store.transitions = ["fail"]
    with pytest.raises(StoreUnavailable):
        cancel(task_id, app=world.app)
    assert world.job(task_id).state is State.PENDING
    assert cancel(task_id, app=world.app) is True
    assert world.job(task_id).state is State.CANCELLED


def test_a_cancel_whose_outcome_cannot_be_read_back_raises(world: World) -> None:
    task_id = delayed(world)
    # Given the write applies, its answer is lost, and every read back fails
    world.store.transitions = ["lose"]
    world.store.gets = ["fail"] * 100
    with pytest.raises(StoreError):
        cancel(task_id, app=world.app)
    # Then the caller learns nothing false; calling again once the store answers is safe
    world.store.gets = []
    cancel(task_id, app=world.app)
    job = world.job(task_id)
    assert job.state is State.CANCELLED
    assert [h.dst for h in job.history].count(State.CANCELLED) == 1


def test_cancel_without_an_app_uses_the_current_app(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails before the fix: Celery's ``current_app`` proxy keyed the runtime registry
    (``TypeError``: no weak reference to a proxy)."""
    task_id = delayed(world)
    monkeypatch.setattr(celery._state._tls, "current_app", world.app)
    assert cancel(task_id) is True
    assert world.job(task_id).state is State.CANCELLED


def race(world: World, task_id: str) -> bool:
    """A beat node sweeps (claims and dispatches) while the application cancels ``task_id``."""
    dispatcher = runtime.runtime_for(world.app).dispatcher
    barrier = threading.Barrier(2)
    cancelled: list[bool] = []

    def sweep() -> None:
        barrier.wait(timeout=10)
        for job in world.store.claim_due(limit=10, node="beat"):
            dispatcher.dispatch(job, retry=False)

    def cancel_it() -> None:
        barrier.wait(timeout=10)
        cancelled.append(cancel(task_id, app=world.app))

    threads = [threading.Thread(target=sweep), threading.Thread(target=cancel_it)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert len(cancelled) == 1 and not any(thread.is_alive() for thread in threads)
    return cancelled[0]


def test_a_cancel_racing_the_sweep_either_cancels_or_lets_it_publish_never_both(
    world: World,
) -> None:
    for _ in range(20):
        # Given a delayed job that has just fallen due
        task_id = delayed(world, seconds=1)
        run_at = world.job(task_id).run_at
        assert run_at is not None
        world.clock.set(run_at + timedelta(seconds=1))
        # When a beat node sweeps it while the application cancels it
        cancelled = race(world, task_id)
        # Then exactly one of them won: cancelled and never published, or published
        published = world.sent.count(task_id)
        final = world.job(task_id).state
        if cancelled:
            assert (final, published) == (State.CANCELLED, 0)
        else:
            assert (final, published) == (State.DISPATCHED, 1)
