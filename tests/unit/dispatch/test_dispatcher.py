"""The dispatch path with an injected publisher: state before publish, and every failure."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery

from celery_exactonce import StoreUnavailable
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.dispatch.dispatcher import DISPATCH_CHUNK, Dispatcher
from celery_exactonce.dispatch.messages import GATED_OPTION, message_headers
from celery_exactonce.dispatch.outcomes import Outcome
from celery_exactonce.dispatch.publisher import CeleryPublisher, PublishFailed, connection_refused
from celery_exactonce.dispatch.retrier import Retrier
from celery_exactonce.observe import metrics
from celery_exactonce.testing import InMemoryStore
from tests.support.helpers import poll, submitted


class Broker:
    """A fake publisher: records messages; raises the fault it is told to."""

    def __init__(self) -> None:
        self.sent: list[tuple[Job, dict[str, Any]]] = []
        self.fault: PublishFailed | None = None
        self.land_before_fault = False

    def __call__(self, job: Job, headers: Mapping[str, Any], extra: Mapping[str, Any]) -> None:
        if self.fault is not None:
            if self.land_before_fault:
                self.sent.append((job, dict(headers)))
            raise self.fault
        self.sent.append((job, dict(headers)))


class FailingStore(InMemoryStore):
    """Fails the next transitions, before or after applying them."""

    fail_next = 0
    after_apply = False

    def transition(self, ref, request):  # type: ignore[no-untyped-def]
        if self.fail_next:
            self.fail_next -= 1
            if self.after_apply:
                super().transition(ref, request)
            raise StoreUnavailable("injected")
        return super().transition(ref, request)


@pytest.fixture(autouse=True)
def _counters() -> None:
    metrics.COUNTERS.reset()


def scheduled(store: InMemoryStore, gated: bool = True, job_id: str = "j1") -> Job:
    result = store.create(submitted(job_id, gated=gated))
    assert result.job is not None
    return result.job


def test_gated_dispatch_writes_dispatched_then_publishes_with_headers() -> None:
    store, broker = InMemoryStore("ns"), Broker()
    job = scheduled(store)
    result = Dispatcher(store, broker, node="n").dispatch(job)
    assert result.outcome is Outcome.PUBLISHED
    ((sent, headers),) = broker.sent
    assert sent.state is State.DISPATCHED and sent.rev != job.rev  # published what the CAS returned
    assert headers["exactonce_job_id"] == "j1" and headers["exactonce_attempt"] == 0
    assert headers["idempotency_key"].startswith("eo1_")
    assert "exactonce_key" not in headers
    assert store.get(job.ref).state is State.DISPATCHED  # type: ignore[union-attr]


def test_plain_job_ends_published() -> None:
    store, broker = InMemoryStore("ns"), Broker()
    job = scheduled(store, gated=False)
    assert Dispatcher(store, broker, node="n").dispatch(job).outcome is Outcome.PUBLISHED
    assert store.get(job.ref).state is State.PUBLISHED  # type: ignore[union-attr]


def test_second_dispatch_of_the_same_listing_loses() -> None:
    store, broker = InMemoryStore("ns"), Broker()
    job = scheduled(store)
    dispatcher = Dispatcher(store, broker, node="n")
    assert dispatcher.dispatch(job).outcome is Outcome.PUBLISHED
    assert dispatcher.dispatch(job).outcome is Outcome.LOST
    assert len(broker.sent) == 1


def test_dispatched_write_fails_nothing_published() -> None:
    store, broker = FailingStore("ns"), Broker()
    job = scheduled(store)
    store.fail_next = 1
    result = Dispatcher(store, broker, node="n").dispatch(job)
    assert result.outcome is Outcome.FAIL_CLOSED and broker.sent == []
    assert metrics.COUNTERS.get("fail_closed", phase="dispatched_write") == 1
    # the retry publishes once
    assert Dispatcher(store, broker, node="n").dispatch(job).outcome is Outcome.PUBLISHED
    assert len(broker.sent) == 1


def test_dispatched_write_that_applied_is_read_back_and_published() -> None:
    store, broker = FailingStore("ns"), Broker()
    job = scheduled(store)
    store.fail_next, store.after_apply = 1, True
    result = Dispatcher(store, broker, node="n").dispatch(job)
    assert result.outcome is Outcome.PUBLISHED and len(broker.sent) == 1


class LosesPublished(InMemoryStore):
    """Every write of ``PUBLISHED`` fails (the publish before it went through)."""

    def transition_many(self, requests, *, brief=False):  # type: ignore[no-untyped-def]
        if any(request.to is State.PUBLISHED for _, request in requests):
            raise StoreUnavailable("injected: the PUBLISHED write failed")
        return super().transition_many(requests, brief=brief)


@pytest.mark.parametrize("batched", [False, True], ids=["dispatch", "dispatch_many"])
def test_a_failed_write_after_the_publish_never_publishes_again(batched: bool) -> None:
    # Given plain jobs whose publish succeeds and whose PUBLISHED write then fails
    store, broker = LosesPublished("ns"), Broker()
    listed = [scheduled(store, gated=False, job_id=f"j{i}") for i in range(3)]
    retrier = Retrier(first_delay=0.01, max_delay=0.05, give_up_after=10)
    dispatcher = Dispatcher(store, broker, node="n", retrier=retrier)
    # When they are dispatched
    if batched:
        results = dispatcher.dispatch_many(listed)
    else:
        results = [dispatcher.dispatch(job) for job in listed]
    # Then each was published once and counts as published; nothing is retried; the
    # jobs stay DISPATCHED for the reconciler (plain: TIMEOUT "unconfirmed")
    assert [r.outcome for r in results] == [Outcome.PUBLISHED] * 3
    assert retrier.pending() == 0
    assert sorted(job.ref.id for job, _ in broker.sent) == ["j0", "j1", "j2"]
    assert {store.get(job.ref).state for job in listed} == {State.DISPATCHED}  # type: ignore[union-attr]


def test_definite_failure_rolls_back() -> None:
    store, broker = InMemoryStore("ns"), Broker()
    job = scheduled(store)
    broker.fault = PublishFailed("refused", definite=True)
    result = Dispatcher(store, broker, node="n").dispatch(job)
    assert result.outcome is Outcome.ROLLED_BACK
    assert result.job is not None and result.job.state is State.SCHEDULED
    assert metrics.COUNTERS.get("publish_rolled_back") == 1
    assert metrics.COUNTERS.get("fail_closed", phase="publish") == 1
    broker.fault = None
    assert Dispatcher(store, broker, node="n").dispatch(result.job).outcome is Outcome.PUBLISHED
    assert len(broker.sent) == 1
    # the record counts both dispatches: the outage shows in its history
    after = store.get(job.ref)
    assert after is not None and after.dispatches == 2
    assert [h.dst for h in after.history][-3:] == [
        State.DISPATCHED,
        State.SCHEDULED,
        State.DISPATCHED,
    ]


def test_failed_rollback_is_counted_and_leaves_dispatched() -> None:
    store = FailingStore("ns")
    job = scheduled(store)

    class RefuseThenBreakStore(Broker):
        def __call__(self, job: Job, headers: Mapping[str, Any], extra: Mapping[str, Any]) -> None:
            store.fail_next = 5  # the rollback write and its read-backs... only transitions fail
            raise PublishFailed("refused", definite=True)

    result = Dispatcher(store, RefuseThenBreakStore(), node="n").dispatch(job)
    assert result.outcome is Outcome.ROLLBACK_FAILED
    assert metrics.COUNTERS.get("rollback_failed", phase="rollback_write") == 1
    assert store.get(job.ref).state is State.DISPATCHED  # type: ignore[union-attr]


def test_ambiguous_failure_keeps_dispatched() -> None:
    store, broker = InMemoryStore("ns"), Broker()
    job = scheduled(store)
    broker.fault, broker.land_before_fault = PublishFailed("reset", definite=False), True
    result = Dispatcher(store, broker, node="n").dispatch(job)
    assert result.outcome is Outcome.AMBIGUOUS and len(broker.sent) == 1
    assert store.get(job.ref).state is State.DISPATCHED  # type: ignore[union-attr]
    assert metrics.COUNTERS.get("publish_ambiguous") == 1


def test_a_gated_job_of_a_task_this_process_does_not_import_is_published() -> None:
    """SCENARIOS 67: the record says the job is gated; the dispatching process's registry
    (a beat that does not import the task modules) is not asked.

    Fails before the fix: a beat without the module ended every delayed job and
    countdown retry ``FAILED 'unknown task'``, though workers run the task.
    """
    store, broker = InMemoryStore("ns"), Broker()
    job = scheduled(store)  # "tasks.t": registered nowhere in this process
    result = Dispatcher(store, broker, node="n").dispatch(job)
    assert result.outcome is Outcome.PUBLISHED and [j.ref for j, _ in broker.sent] == [job.ref]
    assert store.get(job.ref).state is State.DISPATCHED  # type: ignore[union-attr]


def test_occurrence_headers() -> None:
    from datetime import datetime, timezone

    store = InMemoryStore("ns")
    fire = datetime(2026, 3, 29, 1, 0, tzinfo=timezone.utc)
    new = NewJob(
        JobRef.occurrence("occ-1"), "t", State.SCHEDULED, node="n", entry="report", fire_time=fire
    )
    job = store.create(new).job
    assert job is not None
    headers = message_headers(job, "ns")
    assert headers["exactonce_key"] == "report"
    assert headers["exactonce_fire_time"] == "2026-03-29T01:00:00.000000Z"


def test_connection_refused_classification() -> None:
    assert connection_refused(ConnectionRefusedError())
    wrapped = RuntimeError("outer")
    wrapped.__cause__ = ConnectionRefusedError()
    assert connection_refused(wrapped)
    assert not connection_refused(ConnectionResetError())
    assert not connection_refused(TimeoutError())


def test_rolled_back_dispatch_is_retried_in_the_background() -> None:
    # Given a broker that refuses the first publish (nothing sent)
    store, broker = InMemoryStore("ns"), Broker()
    job = scheduled(store)
    broker.fault = PublishFailed("refused", definite=True)
    retrier = Retrier(first_delay=0.01, max_delay=0.05, give_up_after=10)
    dispatcher = Dispatcher(store, broker, node="n", retrier=retrier)
    # When it is dispatched, and the broker comes back
    assert dispatcher.dispatch(job).outcome is Outcome.ROLLED_BACK
    broker.fault = None
    # Then the background retry publishes it exactly once
    poll(lambda: store.get(job.ref).state is State.DISPATCHED)  # type: ignore[union-attr]
    poll(lambda: retrier.pending() == 0)
    assert len(broker.sent) == 1


def test_background_retry_never_publishes_a_job_that_moved_on() -> None:
    store, broker = FailingStore("ns"), Broker()
    job = scheduled(store)
    retrier = Retrier(first_delay=0.05, give_up_after=10)
    dispatcher = Dispatcher(store, broker, node="n", retrier=retrier)
    store.fail_next = 1
    assert dispatcher.dispatch(job).outcome is Outcome.FAIL_CLOSED
    # Meanwhile another node dispatches it
    assert Dispatcher(store, broker, node="other").dispatch(job).outcome is Outcome.PUBLISHED
    poll(lambda: retrier.pending() == 0)
    assert len(broker.sent) == 1


def test_celery_publisher_bounds_each_publish_by_the_publish_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given the publisher of an app on an in-memory broker, with a 2.5 s publish timeout
    app = Celery("pub", broker="memory://", set_as_current=False)
    publisher = CeleryPublisher(app, timeout=2.5)
    sent: list[dict[str, Any]] = []
    real = app.send_task

    def send_task(name: str, **options: Any) -> Any:
        sent.append(options)
        return real(name, **options)

    monkeypatch.setattr(app, "send_task", send_task)
    job = scheduled(InMemoryStore())
    # When a job is published, and one whose entry set its own timeout
    publisher(job, {"h": 1}, {})
    publisher(job, {"h": 1}, {"timeout": 0.5})
    # Then the publish timeout reached the publish; an entry's own is kept; and kombu
    # never retries a publish by itself (a retry after a reset could send it twice)
    assert [options["timeout"] for options in sent] == [2.5, 0.5]
    assert [options["retry"] for options in sent] == [False, False]
    assert sent[0]["headers"] == {"h": 1} and sent[0]["queue"] == "q"


def test_every_publish_of_a_job_with_a_deadline_expires_at_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a job with a deadline
    store = InMemoryStore()
    deadline = store.now() + timedelta(seconds=10)
    new = NewJob(
        JobRef.submitted("late"),
        "tasks.t",
        State.SCHEDULED,
        node="n",
        options={GATED_OPTION: True},
        deadline=deadline,
    )
    job = store.create(new).job
    assert job is not None
    app = Celery("pub", broker="memory://", set_as_current=False)
    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(app, "send_task", lambda name, **options: sent.append(options))
    # When it is dispatched
    result = Dispatcher(store, CeleryPublisher(app), node="n").dispatch(job)
    # Then its message expires at the deadline: a publish that comes late (a node paused
    # between its DISPATCHED write and the publish) is dropped unrun by the worker, as
    # tests/acceptance/test_gate.py shows for an expired message
    assert result.outcome is Outcome.PUBLISHED
    assert [options["expires"] for options in sent] == [deadline]


class BufferingBroker(Broker):
    """A publisher that buffers until ``flush``, as kombu's batch does; ``flush_fault`` fails it."""

    def __init__(self) -> None:
        super().__init__()
        self.buffer: list[tuple[Job, dict[str, Any]]] = []
        self.flush_fault: PublishFailed | None = None
        self.flushes = 0

    def __call__(self, job: Job, headers: Mapping[str, Any], extra: Mapping[str, Any]) -> None:
        self.buffer.append((job, dict(headers)))

    def flush(self) -> None:
        self.flushes += 1
        buffered, self.buffer = self.buffer, []
        if self.flush_fault is not None:
            raise self.flush_fault
        self.sent += buffered


@pytest.mark.parametrize("definite", [True, False], ids=["refused", "ambiguous"])
def test_a_failed_flush_settles_every_job_of_its_chunk_alike(definite: bool) -> None:
    # Given a chunk and a half of plain jobs, and a broker whose first flush fails
    store, broker = InMemoryStore("ns"), BufferingBroker()
    listed = [scheduled(store, gated=False, job_id=f"j{i}") for i in range(DISPATCH_CHUNK + 8)]
    broker.flush_fault = PublishFailed("flush failed", definite=definite)
    dispatcher = Dispatcher(store, broker, node="n")
    first = dispatcher.dispatch_many(listed[:DISPATCH_CHUNK], retry=False)
    # Then none of the first chunk counts as published: all rolled back (nothing was
    # sent) or all ambiguous (kept DISPATCHED for the reconciler), none PUBLISHED
    outcome, state = (
        (Outcome.ROLLED_BACK, State.SCHEDULED)
        if definite
        else (Outcome.AMBIGUOUS, State.DISPATCHED)
    )
    assert [r.outcome for r in first] == [outcome] * DISPATCH_CHUNK
    assert {store.get(job.ref).state for job in listed[:DISPATCH_CHUNK]} == {state}  # type: ignore[union-attr]
    # and once the broker takes messages again, the next chunk is sent at its flush
    broker.flush_fault = None
    rest = dispatcher.dispatch_many(listed[DISPATCH_CHUNK:])
    assert [r.outcome for r in rest] == [Outcome.PUBLISHED] * 8
    assert [job.ref.id for job, _ in broker.sent] == [job.ref.id for job in listed[DISPATCH_CHUNK:]]
    assert broker.flushes == 2


def test_a_payload_that_cannot_be_published_fails_the_job_counted_and_never_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SCENARIOS 35: dispatch raises after the claim (the payload does not encode):
    ``FAILED`` with the reason, counted, logged with the job id; not retried."""
    store, broker = InMemoryStore("ns"), Broker()
    retrier = Retrier(first_delay=0.01)
    job = scheduled(store)
    broker.fault = PublishFailed("cannot encode: <object>", definite=True, permanent=True)
    with caplog.at_level(logging.ERROR, logger="celery_exactonce"):
        result = Dispatcher(store, broker, node="n", retrier=retrier).dispatch(job)
    assert result.outcome is Outcome.FAILED and broker.sent == []
    stored = store.get(job.ref)
    assert stored is not None and stored.state is State.FAILED
    assert "cannot encode" in stored.reason
    assert metrics.COUNTERS.get("dispatch_failed") == 1
    (record,) = [r for r in caplog.records if getattr(r, "action", "") == "dispatch_failed"]
    assert getattr(record, "job_id", None) == job.ref.id
    assert retrier.pending() == 0
