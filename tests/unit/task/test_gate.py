"""The worker gate, one delivery at a time, with store faults injected at exact points.

Each test hands the gate a delivery the way Celery's worker does (a request
pushed on the task, then the task called) and plays the broker itself: a
delivery sent back by the gate is captured at publish time and delivered
again, as often as a broker might copy it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from celery import Celery, signals

from celery_exactonce import StoreUnavailable, runtime
from celery_exactonce.core.formats import MESSAGE_FORMAT
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.dispatch.messages import (
    GATED_OPTION,
    HEADER_FORMAT,
    HEADER_GATE_RUNS,
    message_headers,
)
from celery_exactonce.observe import metrics
from celery_exactonce.task.base import ExactOnceTask
from celery_exactonce.testing import InMemoryStore
from tests.support.deliveries import deliver_to
from tests.support.publishing import publishing

NAMESPACE = "gate-unit"


class ScriptedStore(InMemoryStore):
    """An in-memory store whose next calls fail as scripted.

    ``transitions`` and ``creates``: per call, ``"ok"``, ``"fail"`` (refused
    before applying) or ``"lose"`` (applied, then the answer is lost);
    ``gets``: ``"ok"`` or ``"fail"``. ``down`` fails every call.
    """

    def __init__(self, namespace: str) -> None:
        super().__init__(namespace)
        self.transitions: list[str] = []
        self.creates: list[str] = []
        self.gets: list[str] = []
        self.down = False
        #: Called before every transition (a barrier, to make deliveries race).
        self.before_transition: Any = None

    def _step(self, script: list[str]) -> str:
        if self.down:
            raise StoreUnavailable("injected: store down")
        return script.pop(0) if script else "ok"

    def transition(self, ref, request):  # type: ignore[no-untyped-def]
        if self.before_transition is not None:
            self.before_transition()
        step = self._step(self.transitions)
        if step == "fail":
            raise StoreUnavailable("injected: refused")
        result = super().transition(ref, request)
        if step == "lose":
            raise StoreUnavailable("injected: applied, answer lost")
        return result

    def create(self, new, *, epoch=None):  # type: ignore[no-untyped-def]
        step = self._step(self.creates)
        if step == "fail":
            raise StoreUnavailable("injected: refused")
        result = super().create(new, epoch=epoch)
        if step == "lose":
            raise StoreUnavailable("injected: applied, answer lost")
        return result

    def get(self, ref):  # type: ignore[no-untyped-def]
        if self._step(self.gets) == "fail":
            raise StoreUnavailable("injected: read failed")
        return super().get(ref)


@dataclass
class World:
    app: Celery
    store: ScriptedStore
    runs: list[tuple[str, str, int]] = field(default_factory=list)
    sent_back: list[dict[str, Any]] = field(default_factory=list)

    def task(self, name: str) -> ExactOnceTask:
        task = self.app.tasks[name]
        assert isinstance(task, ExactOnceTask)
        return task


@pytest.fixture
def world() -> Iterator[World]:
    app = Celery("gate-unit", broker="memory://", set_as_current=False)
    app.conf.update(
        exactonce_store_url="memory://",
        exactonce_namespace=NAMESPACE,
        exactonce_retry_delay_store=0.01,
    )
    store = ScriptedStore(NAMESPACE)
    runtime.install(app, store)
    world = World(app, store)

    def body(self: Any, *args: Any) -> str:
        world.runs.append((self.name, self.request.id, self.request.retries))
        return "done"

    for name, options in (("t.body", {}), ("t.other", {}), ("t.last", {"max_retries": 0})):
        app.task(base=ExactOnceTask, shared=False, bind=True, name=name, **options)(body)

    @app.task(base=ExactOnceTask, shared=False, bind=True, name="t.late")
    def late(self: Any, *args: Any) -> str:
        """Its job is timed out (as by the reconciler) while the body runs."""
        world.runs.append((self.name, self.request.id, self.request.retries))
        job = store.get(JobRef.submitted(self.request.id))
        assert job is not None
        _move(store, job, State.TIMEOUT, rev=job.rev)
        return "done"

    for task in app.tasks.values():
        if isinstance(task, ExactOnceTask):
            task.exactonce_gate_timeout = 0.05

    def capture(sender: Any = None, headers: Any = None, body: Any = None, **_kw: Any) -> None:
        if headers and headers.get(HEADER_GATE_RUNS) is not None:
            world.sent_back.append(dict(headers))

    with publishing(app, capture):
        yield world


def dispatched(world: World, task: str = "t.body", attempt: int = 0) -> Job:
    """A ``DISPATCHED`` job of ``task`` at ``attempt`` (its message is what a test delivers)."""
    store = world.store
    created = store.create(
        NewJob(
            JobRef.submitted(uuid.uuid4().hex),
            task,
            State.SCHEDULED,
            node="n",
            args=[1],
            options={GATED_OPTION: True},
        )
    )
    assert created.job is not None
    job = created.job
    for _ in range(attempt):
        job = _move(store, job, State.RUNNING, new_run_id="r")
        job = _move(store, job, State.DISPATCHED, run_id="r", next_attempt=True)
    return job if job.state is State.DISPATCHED else _move(store, job, State.DISPATCHED)


def _move(store: InMemoryStore, job: Job, to: State, **guards: Any) -> Job:
    result = store.transition(
        job.ref, Transition(to, frozenset({job.state}), node="n", reason="test", **guards)
    )
    assert result.applied and result.job is not None
    return result.job


def headers_of(job: Job) -> dict[str, Any]:
    return message_headers(job, NAMESPACE)


def deliver(
    world: World,
    task: str,
    task_id: str,
    headers: dict[str, Any],
    *,
    redelivered: bool = False,
) -> str:
    """Hand the gate one delivery; what became of it: ran, ignored, sent_back or requeued."""
    return deliver_to(world.task(task), task_id, headers, redelivered=redelivered)


def state_of(world: World, job: Job) -> Job:
    current = world.store.get(job.ref)
    assert current is not None
    return current


def test_a_gate_write_whose_answer_was_lost_runs_once_when_the_retried_cas_meets_it(
    world: World,
) -> None:
    """Fails before the fix (FINDINGS F2): the retried CAS met this delivery's own
    ``RUNNING`` and the delivery was dropped as a duplicate; the body never ran."""
    job = dispatched(world)
    # Given a gate write that applies but whose answer is lost, and a read-back that fails
    world.store.transitions = ["lose"]
    world.store.gets = ["fail"]
    # When the gate retries its CAS, which now conflicts with its own RUNNING
    outcome = deliver(world, "t.body", job.ref.id, headers_of(job))
    # Then the delivery that wrote it runs, once, and completes
    assert outcome == "ran"
    assert world.runs == [("t.body", job.ref.id, 0)]
    assert state_of(world, job).state is State.SUCCEEDED


def test_copies_of_a_sent_back_delivery_run_the_attempt_once(world: World) -> None:
    """SCENARIOS 69. Fails before the fix: the sent-back message carried the run id
    as ownership, and both copies of it found ``RUNNING`` under it and ran attempt 0."""
    job = dispatched(world)
    # Given a gate write that applies, its answer lost, the store unreachable past the
    # gate's timeout: the delivery is sent back, unrun
    world.store.transitions = ["lose"]
    world.store.gets = ["fail"] * 1000
    assert deliver(world, "t.body", job.ref.id, headers_of(job)) == "sent_back"
    world.store.gets = []
    assert world.runs == [] and state_of(world, job).state is State.RUNNING
    (copy,) = world.sent_back
    # When the broker delivers the sent-back message twice, and the original once more
    outcomes = [
        deliver(world, "t.body", job.ref.id, copy),
        deliver(world, "t.body", job.ref.id, copy, redelivered=True),
        deliver(world, "t.body", job.ref.id, headers_of(job), redelivered=True),
    ]
    # Then exactly one delivery ran attempt 0, and the job completed
    assert outcomes == ["ran", "ignored", "ignored"]
    assert world.runs == [("t.body", job.ref.id, 0)]
    final = state_of(world, job)
    assert final.state is State.SUCCEEDED
    assert [h.reason for h in final.history if h.dst is State.RUNNING] == [
        "gate",
        "gate: taken over from a delivery sent back",
    ]


def test_a_take_over_whose_answer_is_lost_is_settled_by_reading_back(world: World) -> None:
    """SCENARIOS 69: a ticket redeemed once even when the take-over's own answer is lost."""
    job = dispatched(world)
    world.store.transitions = ["lose"]
    world.store.gets = ["fail"] * 1000
    assert deliver(world, "t.body", job.ref.id, headers_of(job)) == "sent_back"
    world.store.gets = []
    (copy,) = world.sent_back
    # Given the take-over CAS of the sent-back copy applies but its answer is lost
    world.store.transitions = ["fail", "lose"]  # a refused gate CAS, then the take-over
    assert deliver(world, "t.body", job.ref.id, copy) == "ran"
    # Then a second copy cannot redeem the same ticket
    assert deliver(world, "t.body", job.ref.id, copy, redelivered=True) == "ignored"
    assert len(world.runs) == 1


def test_copies_sent_back_twice_still_run_once(world: World) -> None:
    """SCENARIOS 69: a delivery sent back twice; every copy of both generations runs ≤ 1."""
    job = dispatched(world)
    world.store.transitions = ["lose"]
    world.store.gets = ["fail"] * 1000
    assert deliver(world, "t.body", job.ref.id, headers_of(job)) == "sent_back"
    first = world.sent_back[-1]
    # The first copy's take-over applies, its answer is lost, and the store stays down
    world.store.gets = ["fail"] * 1000
    world.store.transitions = ["ok", "lose"]  # the gate CAS meets the ticket; take-over applies
    assert deliver(world, "t.body", job.ref.id, first) == "sent_back"
    second = world.sent_back[-1]
    assert set(second[HEADER_GATE_RUNS]) > set(first[HEADER_GATE_RUNS])
    world.store.gets = []
    outcomes = [
        deliver(world, "t.body", job.ref.id, h, redelivered=True)
        for h in (first, second, first, second)
    ]
    assert outcomes.count("ran") == 1 and len(world.runs) == 1


@pytest.mark.parametrize("task", ["t.last", "t.body"])
def test_a_delivery_on_its_last_attempt_is_sent_back_when_the_store_is_down(
    world: World, task: str
) -> None:
    """SCENARIOS 37. Fails before the fix for ``t.last`` (``max_retries=0``): the send-back
    went through Celery's ``retry``, which raised ``MaxRetriesExceededError``; nothing was
    republished and the job waited for its timeout."""
    job = dispatched(world, task)
    # Given the store is down for longer than the gate's timeout
    world.store.down = True
    # Then the delivery is sent back unrun, for the same attempt
    assert deliver(world, task, job.ref.id, headers_of(job)) == "sent_back"
    (copy,) = world.sent_back
    assert copy["retries"] == 0 and copy["exactonce_attempt"] == 0
    assert world.runs == []
    # and once the store is back, the copy runs the attempt once
    world.store.down = False
    assert deliver(world, task, job.ref.id, copy) == "ran"
    assert deliver(world, task, job.ref.id, copy, redelivered=True) == "ignored"
    assert world.runs == [(task, job.ref.id, 0)]


def test_a_delivery_whose_send_back_fails_is_requeued(world: World) -> None:
    """SCENARIOS 37: the broker refuses the send-back too: the message goes back unrun."""
    job = dispatched(world)
    world.store.down = True
    world.app.conf.broker_url = "redis://127.0.0.1:1/0"  # nothing listens: refused
    world.app.conf.broker_connection_retry = False
    world.app.conf.broker_connection_max_retries = 0
    assert deliver(world, "t.body", job.ref.id, headers_of(job)) == "requeued"
    assert world.runs == []
    assert metrics.COUNTERS.get("fail_closed", phase="gate_read") == 1


def test_a_foreign_message_is_adopted_after_a_create_that_failed(world: World) -> None:
    """SCENARIOS 38. Fails before the fix: after one failed create the next pass raised
    ``Ignore``: the message was acked with no record, no counter and no log."""
    # Given a message without our headers and no record; the first create is refused
    world.store.creates = ["fail"]
    # When it is delivered
    outcome = deliver(world, "t.body", "foreign-1", {})
    # Then it is adopted on the next pass and runs once
    assert outcome == "ran"
    assert world.runs == [("t.body", "foreign-1", 0)]
    job = world.store.get(JobRef.submitted("foreign-1"))
    assert job is not None and job.state is State.SUCCEEDED
    assert job.options.get(GATED_OPTION) is True
    assert metrics.COUNTERS.get("adopted") == 1
    assert metrics.COUNTERS.get("completed", state="SUCCEEDED") == 1


def test_a_foreign_message_whose_adoption_answer_was_lost_runs_once(world: World) -> None:
    """SCENARIOS 38: the create applied, its answer lost: read back, ours, run once."""
    world.store.creates = ["lose"]
    assert deliver(world, "t.body", "foreign-2", {}) == "ran"
    assert deliver(world, "t.body", "foreign-2", {}, redelivered=True) == "ignored"
    assert world.runs == [("t.body", "foreign-2", 0)]


def test_a_message_for_another_tasks_waiting_job_does_not_run_and_is_a_conflict(
    world: World,
) -> None:
    """SCENARIOS 45e. Fails before the fix: the gate's CAS ignored the task name, so
    ``t.body`` ran on ``t.other``'s DISPATCHED job and ``t.other``'s own message was
    then dropped; ``gate_conflict`` stayed 0."""
    job = dispatched(world, "t.other")
    # When a message for t.body carries t.other's job id
    assert deliver(world, "t.body", job.ref.id, headers_of(job)) == "ignored"
    # Then it does not run, it is a conflict, and the record is untouched
    assert world.runs == []
    assert metrics.COUNTERS.get("gate_conflict") == 1
    assert state_of(world, job) == job
    # and t.other's own message still runs
    assert deliver(world, "t.other", job.ref.id, headers_of(job)) == "ran"
    assert world.runs == [("t.other", job.ref.id, 0)]


def test_an_expired_copy_of_an_earlier_attempt_does_not_cancel_the_live_one(
    world: World,
) -> None:
    """Fails before the fix: the revoke handler never compared attempts, so an expired
    copy of attempt 0 cancelled the job waiting for attempt 1."""
    job = dispatched(world, attempt=1)
    stale = {**headers_of(job), "exactonce_attempt": 0}
    task = world.task("t.body")
    request = _Request(job.ref.id, stale, retries=0)
    # When the worker drops an expired copy of attempt 0
    signals.task_revoked.send(sender=task, request=request, terminated=False, expired=True)
    # Then the job still waits for attempt 1
    assert state_of(world, job).state is State.DISPATCHED
    # while an expired copy of attempt 1 itself cancels it
    request = _Request(job.ref.id, headers_of(job), retries=1)
    signals.task_revoked.send(sender=task, request=request, terminated=False, expired=True)
    cancelled = state_of(world, job)
    assert cancelled.state is State.CANCELLED and cancelled.reason == "expired"


class _Request:
    """What Celery's worker hands ``task_revoked`` receivers: a request with headers."""

    def __init__(self, task_id: str, headers: dict[str, Any], retries: int) -> None:
        self.id = task_id
        self.retries = retries
        self.request_dict = {"headers": headers, **headers}


def test_a_first_delivery_the_job_does_not_wait_for_is_a_warning(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    """A delivery refused that no broker redelivered means a run lost: WARNING, counted.
    A redelivery refused is the gate's ordinary work: DEBUG, counted."""
    job = dispatched(world)
    _move(world.store, job, State.PUBLISHED, rev=job.rev)  # written as if plain
    with caplog.at_level(logging.DEBUG, logger="celery_exactonce"):
        assert deliver(world, "t.body", job.ref.id, headers_of(job)) == "ignored"
        assert deliver(world, "t.body", job.ref.id, headers_of(job), redelivered=True) == (
            "ignored"
        )
    levels = [
        r.levelno for r in caplog.records if getattr(r, "action", "") == "suppressed_duplicate"
    ]
    assert levels == [logging.WARNING, logging.DEBUG]
    assert metrics.COUNTERS.get("suppressed_duplicate", where="PUBLISHED") == 2


def test_an_outcome_that_comes_too_late_is_noted_in_the_record(world: World) -> None:
    """The design's rule for a terminal job: a late outcome is an annotation, never a
    change of state. Before, it was only logged."""
    job = dispatched(world, "t.late")
    assert deliver(world, "t.late", job.ref.id, headers_of(job)) == "ran"
    final = state_of(world, job)
    assert final.state is State.TIMEOUT
    note = final.history[-1]
    assert note.src is note.dst is State.TIMEOUT
    assert note.reason.startswith("late outcome of run") and "SUCCEEDED" in note.reason


def test_two_deliveries_at_the_same_moment_run_the_attempt_once(world: World) -> None:
    """SCENARIOS 39: two workers receive the same job at once; one gate CAS wins."""
    job = dispatched(world)
    barrier = threading.Barrier(2, timeout=10)
    calls = itertools.count()

    def together() -> None:  # both gate writes reach the store at once; later writes do not wait
        if next(calls) < 2:
            barrier.wait()

    world.store.before_transition = together
    outcomes: list[str] = []

    def worker() -> None:
        outcomes.append(deliver(world, "t.body", job.ref.id, headers_of(job)))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    world.store.before_transition = None
    assert sorted(outcomes) == ["ignored", "ran"]
    assert world.runs == [("t.body", job.ref.id, 0)]


def test_a_message_of_a_newer_format_is_sent_back_not_run(world: World) -> None:
    """A newer version sent it: this worker cannot read its headers, and says so."""
    job = dispatched(world)
    headers = {**headers_of(job), HEADER_FORMAT: MESSAGE_FORMAT + 1}
    outcome = deliver(world, "t.body", job.ref.id, headers)
    assert outcome == "sent_back"
    assert world.runs == []
    assert state_of(world, job).state is State.DISPATCHED  # untouched, for a newer worker
    assert metrics.COUNTERS.get("format_too_new", task="t.body") == 1
    assert headers_of(job)[HEADER_FORMAT] == MESSAGE_FORMAT  # what this version sends
    assert deliver(world, "t.body", job.ref.id, headers_of(job)) == "ran"
