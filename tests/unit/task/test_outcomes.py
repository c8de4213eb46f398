"""A run's outcome carried to its thread's next gate write, in a worker process.

In a worker's busy thread (its last gate write came within ``CARRY_FOR`` of the
run before) the task returns with its outcome not yet written: the next gate
write of the same thread takes it, in the same store call; an outcome no gate
takes is written by the heartbeat thread within ``CARRY_FOR``; a process
that exits writes what it carries. Any other outcome than a body's return, and
every outcome outside a ``celery worker`` process, is written at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from celery import Celery, signals

from celery_exactonce import StoreUnavailable, runtime
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import Transition
from celery_exactonce.dispatch.messages import message_headers
from celery_exactonce.observe import metrics
from celery_exactonce.task import outcomes
from celery_exactonce.task.base import ExactOnceTask
from celery_exactonce.task.heartbeats import heartbeats
from celery_exactonce.testing import InMemoryStore
from tests.support.deliveries import deliver_to
from tests.unit.task.test_gate import dispatched

NAMESPACE = "outcomes-unit"
#: Bound on every wait of these tests.
WAIT = 10.0


class CountingStore(InMemoryStore):
    """An in-memory store that records each ``transition_many`` call (its targets and the
    thread that made it), and fails the next ones as asked."""

    def __init__(self, namespace: str) -> None:
        super().__init__(namespace)
        self.calls: list[tuple[list[State], str]] = []
        self.fail_next = 0

    def transition_many(self, requests, *, brief=False):  # type: ignore[no-untyped-def]
        self.calls.append(([t.to for _, t in requests], threading.current_thread().name))
        if self.fail_next:
            self.fail_next -= 1
            raise StoreUnavailable("injected: no answer")
        return super().transition_many(requests, brief=brief)


@dataclass
class World:
    app: Celery
    store: CountingStore
    bodies: list[str] = field(default_factory=list)

    def dispatched(self, task: str = "t.body") -> Job:
        return dispatched(self, task)  # type: ignore[arg-type]  # (its world: a store, an app)

    def deliver(self, job: Job, name: str = "t.body") -> str:
        task = self.app.tasks[name]
        assert isinstance(task, ExactOnceTask)
        return deliver_to(task, job.ref.id, message_headers(job, NAMESPACE))

    def state(self, job: Job) -> State:
        current = self.store.get(job.ref)
        assert current is not None
        return current.state


def _world(in_worker: bool) -> Iterator[World]:
    app = Celery("outcomes-unit", broker="memory://", set_as_current=False)
    app.conf.update(
        exactonce_store_url="memory://",
        exactonce_namespace=NAMESPACE,
        exactonce_retry_delay_store=0.01,
    )
    store = CountingStore(NAMESPACE)
    runtime.install(app, store)
    world = World(app, store)

    @app.task(base=ExactOnceTask, shared=False, bind=True, name="t.body")
    def body(self: Any, *args: Any) -> str:
        world.bodies.append(self.request.id)
        return "done"

    @app.task(base=ExactOnceTask, shared=False, bind=True, name="t.fails")
    def fails(self: Any, *args: Any) -> str:
        world.bodies.append(self.request.id)
        raise ValueError("the body failed")

    for task in app.tasks.values():
        if isinstance(task, ExactOnceTask):
            task.exactonce_gate_timeout = 0.05
    metrics.COUNTERS.reset()
    outcomes.CARRIED.enabled = in_worker
    if in_worker:  # this thread ran a gated task just before (its next one's gate says so)
        outcomes.CARRIED._busy.add(threading.get_ident())
    try:
        yield world
    finally:
        outcomes.CARRIED.enabled = False
        outcomes.CARRIED.flush(every=True)
        outcomes.CARRIED._busy.clear()
        outcomes.CARRIED._ended.clear()
        runtime.reset(app)


@pytest.fixture
def worker() -> Iterator[World]:
    """A gated task run as a worker process runs it (the worker's signals sent)."""
    yield from _world(in_worker=True)


@pytest.fixture
def outside() -> Iterator[World]:
    yield from _world(in_worker=False)


def _until(what: str, check: Any) -> None:
    deadline = time.monotonic() + WAIT
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def test_the_next_gate_write_of_the_thread_carries_the_outcome_in_the_same_call(
    worker: World,
) -> None:
    first, second = worker.dispatched(), worker.dispatched()
    outcomes.CARRIED.flush(every=True)  # (nothing carried yet)
    # When a run ends, its outcome is not written yet
    assert worker.deliver(first) == "ran"
    assert worker.state(first) is State.RUNNING
    calls = len(worker.store.calls)
    # Then the next delivery's gate writes it, in its own call
    assert worker.deliver(second) == "ran"
    here = threading.current_thread().name
    assert worker.store.calls[calls] == ([State.SUCCEEDED, State.RUNNING], here)
    assert worker.state(first) is State.SUCCEEDED
    assert metrics.COUNTERS.get("completed") == 1
    assert worker.bodies == [first.ref.id, second.ref.id]


def test_an_outcome_no_gate_takes_is_written_by_the_heartbeat_thread(worker: World) -> None:
    job = worker.dispatched()
    assert worker.deliver(job) == "ran"
    # When no other delivery comes, the heartbeat thread writes it within CARRY_FOR
    _until("the carried outcome was written", lambda: worker.state(job) is State.SUCCEEDED)
    assert worker.store.calls[-1] == ([State.SUCCEEDED], "exactonce-heartbeat")


def test_a_process_that_exits_writes_what_it_carries(worker: World) -> None:
    job = worker.dispatched()
    # Given an outcome due much later than now
    carry_for = outcomes.CARRY_FOR
    outcomes.CARRY_FOR = WAIT * 10
    try:
        assert worker.deliver(job) == "ran"
    finally:
        outcomes.CARRY_FOR = carry_for
    assert worker.state(job) is State.RUNNING
    # When the worker process shuts down (its signal), it is written at once
    outcomes._exiting()
    assert worker.state(job) is State.SUCCEEDED


def test_scenario_41_a_joint_write_without_answer_writes_the_outcome_and_the_gate_goes_on(
    worker: World,
) -> None:
    first, second = worker.dispatched(), worker.dispatched()
    assert worker.deliver(first) == "ran"
    # Given the joint write's answer lost (the call failed)
    worker.store.fail_next = 1
    # When the next delivery comes, it still runs, once, and the outcome is written
    assert worker.deliver(second) == "ran"
    assert worker.state(first) is State.SUCCEEDED
    assert worker.bodies == [first.ref.id, second.ref.id]
    assert metrics.COUNTERS.get("completion_write_failed") == 0


def test_a_late_outcome_carried_is_noted_and_changes_nothing(worker: World) -> None:
    first, second = worker.dispatched(), worker.dispatched()
    assert worker.deliver(first) == "ran"
    # Given the reconciler timed the first job out while its outcome was carried
    current = worker.store.get(first.ref)
    assert current is not None
    timeout = Transition(
        State.TIMEOUT, frozenset({State.RUNNING}), node="r", reason="stale", rev=current.rev
    )
    assert worker.store.transition(first.ref, timeout).applied
    # When the next gate carries it, it is refused: noted, the state stays TIMEOUT
    assert worker.deliver(second) == "ran"
    assert worker.state(first) is State.TIMEOUT
    assert metrics.COUNTERS.get("late_outcome") == 1
    record = worker.store.get(first.ref)
    assert record is not None and "late outcome" in record.history[-1].reason


def test_outside_a_worker_the_outcome_is_written_at_once(outside: World) -> None:
    job = outside.dispatched()
    assert outside.deliver(job) == "ran"
    assert outside.state(job) is State.SUCCEEDED
    assert outside.store.calls[-1] == ([State.SUCCEEDED], threading.current_thread().name)


def test_only_a_busy_thread_carries_one_whose_last_run_ended_within_carry_for(
    worker: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(outcomes, "CARRY_FOR", 0.05)
    outcomes.CARRIED._busy.clear()
    first, second, third, fourth = (worker.dispatched() for _ in range(4))
    # A thread's first run (no run before it) is written at once
    assert worker.deliver(first) == "ran"
    assert worker.state(first) is State.SUCCEEDED
    # The next, its gate within CARRY_FOR of the first's end, is carried
    assert worker.deliver(second) == "ran"
    assert worker.state(second) is State.RUNNING
    assert worker.deliver(third) == "ran"
    assert worker.state(second) is State.SUCCEEDED  # (with the third's gate write)
    # A run whose gate comes later than CARRY_FOR after the last one's end is not
    _until("the heartbeat thread wrote the third", lambda: worker.state(third) is State.SUCCEEDED)
    ended = time.monotonic()
    _until("CARRY_FOR went by", lambda: time.monotonic() - ended > outcomes.CARRY_FOR)
    assert worker.deliver(fourth) == "ran"
    assert worker.state(fourth) is State.SUCCEEDED


def test_in_a_worker_a_failure_is_written_at_once_before_celery_stores_its_result(
    worker: World,
) -> None:
    first, failing = worker.dispatched(), worker.dispatched("t.fails")
    assert worker.deliver(first) == "ran"
    # When a body raises, its FAILED is in the record as the task returns (a reader who
    # saw the result FAILURE reads the record's end); the one carried before went first
    with pytest.raises(ValueError, match="the body failed"):
        worker.deliver(failing, "t.fails")
    assert worker.state(failing) is State.FAILED
    assert worker.state(first) is State.SUCCEEDED
    assert worker.bodies == [first.ref.id, failing.ref.id]


def test_only_celery_worker_carries_not_a_worker_built_in_a_test() -> None:
    assert not outcomes.CARRIED.enabled
    try:
        # A WorkController built in this process (a test's worker) sends worker_init, and
        # its solo pool worker_process_init: neither turns carrying on
        signals.worker_init.send(sender=None)
        signals.worker_process_init.send(sender=None)
        assert not outcomes.CARRIED.enabled
        # ``celery worker`` sends celeryd_init before its pool forks (the children inherit)
        signals.celeryd_init.send(sender="w@host", instance=None, conf=None, options={})
        assert outcomes.CARRIED.enabled
    finally:
        outcomes.CARRIED.enabled = False


def test_the_heartbeat_thread_runs_a_call_once_at_its_time() -> None:
    ran: list[float] = []

    def call() -> None:
        ran.append(time.monotonic())

    at = time.monotonic() + 0.05
    heartbeats.call_at(at, call)
    heartbeats.call_at(at + 60, call)  # asked again, later: the earlier time stands
    _until("the call ran", lambda: bool(ran))
    assert ran[0] >= at
    # And it is not kept to run again
    assert call not in heartbeats._calls and len(ran) == 1
