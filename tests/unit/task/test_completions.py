"""A run's completion handed to the process's writer thread, on a store that defers them.

A store whose writes wait for a disk flush (``defers_completions``: the SQL
stores on PostgreSQL and MySQL/MariaDB) has a run's outcome written by one
thread of the process: the task returns before the write is made, the next
body of the same thread waits for it, and a process that exits writes every
one first. Elsewhere (another store, an eager run) the outcome is written at
once, on the caller's thread.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from celery import Celery

from celery_exactonce import runtime
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.dispatch.messages import GATED_OPTION, message_headers
from celery_exactonce.task import completions
from celery_exactonce.task.base import ExactOnceTask
from celery_exactonce.testing import InMemoryStore
from tests.support.deliveries import deliver_to

NAMESPACE = "completions-unit"
#: Bound on every wait of these tests.
WAIT = 10.0


class HeldStore(InMemoryStore):
    """An in-memory store that says it defers completions, whose completion writes wait
    for :attr:`release` (and record the thread that made them)."""

    def __init__(self, namespace: str, *, defers: bool = True) -> None:
        super().__init__(namespace)
        self.defers_completions = defers
        self.release = threading.Event()
        self.release.set()
        #: ``(job id, state, thread name)`` of every completion write, as it is made.
        self.completed: list[tuple[str, State, str]] = []

    def transition_many(self, requests, *, brief=False):  # type: ignore[no-untyped-def]
        if any(t.expect == frozenset({State.RUNNING}) for _, t in requests):
            assert self.release.wait(WAIT), "a completion write was never released"
            for ref, t in requests:
                self.completed.append((ref.id, t.to, threading.current_thread().name))
        return super().transition_many(requests, brief=brief)


@dataclass
class World:
    app: Celery
    store: HeldStore
    bodies: list[tuple[str, list[str]]] = field(default_factory=list)

    def deliver(self, job: Job) -> str:
        task = self.app.tasks["t.body"]
        assert isinstance(task, ExactOnceTask)
        return deliver_to(task, job.ref.id, message_headers(job, NAMESPACE))

    def dispatched(self) -> Job:
        new = NewJob(
            JobRef.submitted(uuid.uuid4().hex),
            "t.body",
            State.SCHEDULED,
            node="n",
            args=[1],
            options={GATED_OPTION: True},
        )
        created = self.store.create(new)
        assert created.job is not None
        moved = self.store.transition(
            new.ref,
            Transition(State.DISPATCHED, frozenset({State.SCHEDULED}), node="n", reason="t"),
        )
        assert moved.job is not None
        return moved.job

    def state(self, job: Job) -> State:
        current = self.store.get(job.ref)
        assert current is not None
        return current.state


def _world(defers: bool) -> Iterator[World]:
    app = Celery("completions-unit", broker="memory://", set_as_current=False)
    app.conf.update(exactonce_store_url="memory://", exactonce_namespace=NAMESPACE)
    store = HeldStore(NAMESPACE, defers=defers)
    runtime.install(app, store)
    world = World(app, store)

    @app.task(base=ExactOnceTask, shared=False, bind=True, name="t.body")
    def body(self: Any, *args: Any) -> str:
        # What the store held when this body started: every earlier run's outcome
        world.bodies.append((self.request.id, [job_id for job_id, *_ in store.completed]))
        return "done"

    try:
        yield world
    finally:
        store.release.set()
        assert completions.COMPLETIONS.drain(WAIT)
        runtime.reset(app)


@pytest.fixture
def world() -> Iterator[World]:
    yield from _world(defers=True)


@pytest.fixture
def undeferred() -> Iterator[World]:
    yield from _world(defers=False)


def test_the_task_returns_before_its_completion_which_the_writer_thread_then_makes(
    world: World,
) -> None:
    job = world.dispatched()
    # Given completion writes held back
    world.store.release.clear()
    # When a delivery runs, it returns with its outcome not yet written
    assert world.deliver(job) == "ran"
    assert world.state(job) is State.RUNNING
    # Then, released, the writer thread writes it
    world.store.release.set()
    assert completions.COMPLETIONS.drain(WAIT)
    assert world.state(job) is State.SUCCEEDED
    assert world.store.completed == [(job.ref.id, State.SUCCEEDED, "exactonce-completions")]


def test_the_next_body_of_the_thread_runs_only_once_the_last_outcome_is_written(
    world: World,
) -> None:
    first, second = world.dispatched(), world.dispatched()
    world.store.release.clear()
    assert world.deliver(first) == "ran"
    seen: list[list[str]] = []

    def release_once_its_gate_passed() -> None:
        deadline = time.monotonic() + WAIT
        while world.state(second) is not State.RUNNING and time.monotonic() < deadline:
            time.sleep(0.001)
        seen.append([job_id for job_id, _ in world.bodies])
        world.store.release.set()

    releaser = threading.Thread(target=release_once_its_gate_passed)
    releaser.start()
    # When the same thread takes the next delivery while the first outcome is still held
    assert world.deliver(second) == "ran"
    releaser.join(WAIT)
    # Then its gate passed (the job RUNNING) with its body not started until the release
    assert world.state(second) is not State.DISPATCHED
    assert seen == [[first.ref.id]]
    # And it started with the first outcome written
    assert world.bodies[1] == (second.ref.id, [first.ref.id])
    assert completions.COMPLETIONS.drain(WAIT)
    assert world.state(first) is world.state(second) is State.SUCCEEDED


def test_an_eager_run_and_a_store_that_does_not_defer_write_the_outcome_at_once(
    world: World, undeferred: World
) -> None:
    # An eager run (task.apply) on a store that defers
    task = world.app.tasks["t.body"]
    assert task.apply(args=(1,)).get() == "done"
    # A worker's run on a store that does not
    job = undeferred.dispatched()
    assert undeferred.deliver(job) == "ran"
    assert undeferred.state(job) is State.SUCCEEDED
    # Both on the caller's thread
    here = threading.current_thread().name
    assert [name for *_, name in world.store.completed] == [here]
    assert [name for *_, name in undeferred.store.completed] == [here]


def test_a_process_that_exits_writes_every_outcome_handed_over_first(world: World) -> None:
    jobs = [world.dispatched() for _ in range(3)]
    world.store.release.clear()
    for job in jobs[:1]:
        assert world.deliver(job) == "ran"
    # Handed over from other threads too (a threads pool)
    others = [threading.Thread(target=world.deliver, args=(job,)) for job in jobs[1:]]
    for other in others:
        other.start()
        other.join(WAIT)
    assert {world.state(job) for job in jobs} == {State.RUNNING}
    # When the process exits (its shutdown signal drains the writer), with writes still held
    drained: list[bool] = []
    draining = threading.Thread(target=lambda: drained.append(completions.COMPLETIONS.drain(WAIT)))
    draining.start()
    assert drained == []  # it waits for them
    world.store.release.set()
    draining.join(WAIT)
    # Then every outcome is written
    assert drained == [True]
    assert {world.state(job) for job in jobs} == {State.SUCCEEDED}


def test_a_drain_that_times_out_says_so_and_goes_on(world: World) -> None:
    job = world.dispatched()
    world.store.release.clear()
    assert world.deliver(job) == "ran"
    assert completions.COMPLETIONS.drain(0.01) is False
    world.store.release.set()
    assert completions.COMPLETIONS.drain(WAIT) is True
    assert world.state(job) is State.SUCCEEDED
