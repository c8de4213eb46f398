"""The worker gate in a real (in-process) Celery worker on the in-memory broker.

The store is an InMemoryStore installed as the app's runtime; messages are
duplicated by publishing the same job twice, as a broker redelivery would.
Real worker processes on Redis and RabbitMQ brokers are in tests/acceptance.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.exceptions import Reject

from celery_exactonce import (
    ConfigurationError,
    ExactOnceTask,
    JobConflict,
    StoreUnavailable,
    SubmitAmbiguous,
    cancel,
    runtime,
)
from celery_exactonce.beat.scheduler import ExactOnceScheduler
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.dispatch.messages import GATED_OPTION, message_headers, replacement_job_id
from celery_exactonce.observe import metrics
from celery_exactonce.testing import InMemoryStore
from tests.support.helpers import poll
from tests.support.reconciling import put

LEDGER: list[tuple[str, str, int, Any]] = []
#: A file name that is not UTF-8, as ``os.listdir`` decodes it (lone surrogates).
NON_UTF8_NAME = b"report-\xff.csv".decode("utf-8", "surrogateescape")
#: Values kombu's JSON carries and plain JSON does not (issue 12 of the tracker).
TYPED_ARGS = (
    b"\x00\xffraw",
    datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc),
    uuid.UUID(int=42),
    Decimal("19.99"),
)
LOCK = threading.Lock()


class FlakyStore(InMemoryStore):
    """An in-memory store whose transitions fail while ``down`` is set.

    With ``lose_next_create``, the next create applies, then its answer is
    lost and the store goes ``down`` (so the read-back fails as well).
    """

    down = False
    lose_next_create = False
    fail_transitions = 0
    """This many next transitions fail (before applying), as in a short outage."""

    def create(self, new, *, epoch=None):  # type: ignore[no-untyped-def]
        result = super().create(new, epoch=epoch)
        if self.lose_next_create:
            self.lose_next_create = False
            self.down = True
            raise StoreUnavailable("injected: answer lost after commit")
        return result

    def transition(self, ref, request):  # type: ignore[no-untyped-def]
        if self.down:
            raise StoreUnavailable("injected: store down")
        if self.fail_transitions > 0:
            self.fail_transitions -= 1
            raise StoreUnavailable("injected: transition refused")
        return super().transition(ref, request)

    def get(self, ref):  # type: ignore[no-untyped-def]
        if self.down:
            raise StoreUnavailable("injected: store down")
        return super().get(ref)


def record(task: Any, *args: Any) -> None:
    with LOCK:
        LEDGER.append((task.name, task.request.id, task.request.retries, args))


def make_app() -> Celery:
    app = Celery("gate-tests", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.update(
        exactonce_store_url="memory://",
        exactonce_retry_delay_store=0.05,
        exactonce_heartbeat_interval=0.05,
        exactonce_tick_interval=0.05,
        beat_schedule={},
        task_acks_late=True,
        worker_hijack_root_logger=False,
        broker_transport_options={"polling_interval": 0.05},
    )

    @app.task(base=ExactOnceTask, shared=False, bind=True, name="t.add")
    def add(self: Any, x: int, y: int) -> int:
        record(self, x, y, self.request.idempotency_key)
        return x + y

    @app.task(base=ExactOnceTask, shared=False, bind=True, name="t.retry", max_retries=5)
    def retrying(self: Any, fail_until: int) -> int:
        record(self, fail_until)
        if self.request.retries < fail_until:
            raise self.retry(countdown=0.01, args=(fail_until,))
        return self.request.retries

    @app.task(
        base=ExactOnceTask,
        shared=False,
        bind=True,
        name="t.auto",
        autoretry_for=(RuntimeError,),
        max_retries=3,
        default_retry_delay=0.01,
    )
    def auto(self: Any) -> str:
        record(self)
        if self.request.retries < 2:
            raise RuntimeError("flaky")
        return "ok"

    @app.task(base=ExactOnceTask, shared=False, bind=True, name="t.slow")
    def slow(self: Any, seconds: float) -> None:
        record(self, seconds)
        time.sleep(seconds)  # the body's own work, during which heartbeats must flow

    @app.task(base=ExactOnceTask, shared=False, bind=True, name="t.requeue")
    def requeue(self: Any) -> str:
        record(self)
        if self.request.retries == 0:
            raise Reject("try elsewhere", requeue=True)
        return "again"

    @app.task(base=ExactOnceTask, shared=False, bind=True, name="t.hopeless", max_retries=2)
    def hopeless(self: Any) -> None:
        record(self)
        raise self.retry(countdown=0.01)

    @app.task(base=ExactOnceTask, shared=False, bind=True, name="t.replacing")
    def replacing(self: Any) -> None:
        record(self)
        raise self.replace(self.app.tasks["t.add"].s(1, 1))

    @app.task(base=ExactOnceTask, shared=False, bind=True, name="t.total")
    def total(self: Any, parts: list[int]) -> int:
        record(self, sorted(parts))
        return sum(parts)

    @app.task(base=ExactOnceTask, shared=False, bind=True, name="t.outage")
    def outage(self: Any, failing_writes: int) -> str:
        record(self, failing_writes)
        store = runtime.runtime_for(self.app).store
        assert isinstance(store, FlakyStore)
        store.fail_transitions = failing_writes  # the completion write meets an outage
        return "done"

    @app.task(base=ExactOnceTask, shared=False, bind=True, name="t.other")
    def other(self: Any) -> None:
        record(self)

    @app.task(base=ExactOnceTask, shared=False, bind=True, name="t.echo")
    def echo(self: Any, *args: Any, **kwargs: Any) -> None:
        record(self, args, kwargs)

    @app.task(base=ExactOnceTask, shared=False, bind=True, name="t.badname")
    def badname(self: Any) -> None:
        record(self)
        raise OSError(f"cannot read {NON_UTF8_NAME}")

    return app


@contextlib.contextmanager
def beat_thread(app: Celery) -> Iterator[None]:
    """A beat node (no entries) in a thread: it sweeps the due delayed jobs."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            scheduler = ExactOnceScheduler(app)  # off the main thread: no signal handler
            while not stop.is_set():
                stop.wait(min(scheduler.tick(), 0.05))
        except BaseException as exc:  # reported by the fixture
            errors.append(exc)

    thread = threading.Thread(target=run, name="beat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)
    assert not errors, errors


@pytest.fixture(scope="module")
def worker_app() -> Iterator[Celery]:
    """One app, one in-process worker and one beat thread for the module.

    One worker only: stopping an in-process worker sets Celery's process-wide
    stop flag, which would stop any other in-process worker too.
    """
    app = make_app()
    runtime.install(app, FlakyStore("gate"))
    with (
        start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10),
        beat_thread(app),
    ):
        yield app
    runtime.reset(app)


@pytest.fixture
def app(worker_app: Celery) -> Celery:
    LEDGER.clear()
    metrics.COUNTERS.reset()
    store = store_of(worker_app)
    store.down, store.fail_transitions = False, 0
    return worker_app


def runs(task_id: str) -> list[tuple[str, str, int, Any]]:
    with LOCK:
        return [row for row in LEDGER if row[1] == task_id]


def store_of(app: Celery) -> FlakyStore:
    store = runtime.runtime_for(app).store
    assert isinstance(store, FlakyStore)
    return store


def job_state(app: Celery, task_id: str) -> State | None:
    job = store_of(app).get(JobRef.submitted(task_id))
    return job.state if job else None


def republish(app: Celery, task_id: str) -> None:
    """Send the job's message again, as a broker redelivery would."""
    job = store_of(app).get(JobRef.submitted(task_id))
    assert job is not None
    app.send_task(
        job.task,
        args=job.args,
        kwargs=job.kwargs,
        task_id=task_id,
        headers=message_headers(job, "gate"),
        retries=job.attempt,
    )


def test_runs_once_and_records_success(app: Celery) -> None:
    result = app.tasks["t.add"].delay(2, 3)
    poll(lambda: job_state(app, result.id) is State.SUCCEEDED)
    (row,) = runs(result.id)
    assert row[3][:2] == (2, 3) and row[3][2].startswith("eo1_")  # idempotency key in the body


def test_heartbeats_keep_a_long_body_fresh(app: Celery) -> None:
    result = app.tasks["t.slow"].delay(0.5)
    poll(lambda: job_state(app, result.id) is State.SUCCEEDED)
    job = store_of(app).get(JobRef.submitted(result.id))
    assert job is not None and job.heartbeat_at is not None
    gate = next(h for h in job.history if h.dst is State.RUNNING)
    # touched by heartbeats well after the gate, before the body ended
    assert (job.heartbeat_at - gate.at).total_seconds() >= 0.2


def test_reject_with_requeue_runs_the_next_attempt_once(app: Celery) -> None:
    result = app.tasks["t.requeue"].delay()
    assert result.get(timeout=10) == "again"
    poll(lambda: job_state(app, result.id) is State.SUCCEEDED)
    job = store_of(app).get(JobRef.submitted(result.id))
    assert job is not None and job.attempt == 1
    assert [row[2] for row in runs(result.id)] == [0, 1]


def test_a_task_out_of_retries_ends_failed_after_one_run_per_attempt(app: Celery) -> None:
    result = app.tasks["t.hopeless"].delay()
    poll(lambda: job_state(app, result.id) is State.FAILED)
    assert [row[2] for row in runs(result.id)] == [0, 1, 2]
    job = store_of(app).get(JobRef.submitted(result.id))
    assert job is not None and job.attempt == 2 and "MaxRetriesExceeded" in job.reason


def test_replace_runs_the_replacement_as_a_job_of_its_own(app: Celery) -> None:
    result = app.tasks["t.replacing"].delay()
    assert result.get(timeout=10) == 2  # the caller's result is the replacement's
    replacement = JobRef.submitted(replacement_job_id(result.id, 1))
    poll(lambda: job_state(app, replacement.id) is State.SUCCEEDED)
    job = store_of(app).get(JobRef.submitted(result.id))
    assert job is not None and job.state is State.SUCCEEDED
    assert job.reason == f"replaced by {replacement}"
    assert [row[0] for row in runs(result.id)] == ["t.replacing", "t.add"]


def test_a_chord_fires_its_callback_once_though_a_header_task_is_delivered_twice(
    app: Celery,
) -> None:
    from celery import chord

    add = app.tasks["t.add"]
    # Given a chord of three gated header tasks and a gated callback
    result = chord([add.s(i, i) for i in range(3)])(app.tasks["t.total"].s())
    assert result.get(timeout=15) == 6
    # When a header task's message is delivered again
    header = next(row for row in LEDGER if row[0] == "t.add")
    republish(app, header[1])
    poll(lambda: metrics.COUNTERS.get("suppressed_duplicate") >= 1)
    # Then every header ran once and the callback fired once
    assert sorted(row[3][:2] for row in LEDGER if row[0] == "t.add") == [(0, 0), (1, 1), (2, 2)]
    assert [row[3] for row in LEDGER if row[0] == "t.total"] == [([0, 2, 4],)]


def test_chain_of_gated_tasks_runs_each_step_once(app: Celery) -> None:
    from celery import chain

    # Given a chain add(1, 2) -> add(<3>, 10) whose first step is delivered twice
    result = chain(app.tasks["t.add"].s(1, 2), app.tasks["t.add"].s(10)).apply_async()
    poll(lambda: any(row[3][:2] == (3, 10) for row in LEDGER))
    first = next(row for row in LEDGER if row[3][:2] == (1, 2))
    republish(app, first[1])
    poll(lambda: metrics.COUNTERS.get("suppressed_duplicate") >= 1)
    # Then each step ran once: the duplicate fired no second callback
    assert [row[3][:2] for row in LEDGER] == [(1, 2), (3, 10)]
    assert result.id


def test_redelivery_is_suppressed(app: Celery) -> None:
    result = app.tasks["t.add"].delay(1, 1)
    poll(lambda: job_state(app, result.id) is State.SUCCEEDED)
    republish(app, result.id)
    republish(app, result.id)
    poll(lambda: metrics.COUNTERS.get("suppressed_duplicate") == 2)
    assert len(runs(result.id)) == 1


def _in_state(app: Celery, state: State) -> str:
    """A ``t.add(2, 3)`` job in ``state`` (the current attempt's), its message not yet sent."""
    store = store_of(app)
    if state is State.PENDING:
        later = store.now() + timedelta(hours=1)
        new = NewJob(
            JobRef.submitted(uuid.uuid4().hex),
            "t.add",
            State.PENDING,
            node="test",
            args=[2, 3],
            options={GATED_OPTION: True},
            run_at=later,
        )
        created = store.create(new)
        assert created.job is not None
        return created.job.ref.id
    return put(store, app, state, "t.add", args=[2, 3]).ref.id


@pytest.mark.parametrize("state", list(State), ids=lambda state: state.value)
def test_a_delivery_runs_only_if_its_job_waits_for_it(app: Celery, state: State) -> None:
    """SCENARIOS 36: a delivery from every starting state; it runs from SCHEDULED or
    DISPATCHED at its attempt, and is acked unrun (``Ignore``) from every other."""
    # Given a job in ``state``, and a delivery of its current attempt
    task_id = _in_state(app, state)
    before = store_of(app).get(JobRef.submitted(task_id))
    republish(app, task_id)
    # Then it runs if the job is SCHEDULED or DISPATCHED (its message may land before the
    # DISPATCHED write is seen); from any other state it is acked unrun: no body, no
    # result, the record unchanged
    if state in (State.SCHEDULED, State.DISPATCHED):
        poll(lambda: job_state(app, task_id) is State.SUCCEEDED)
        assert len(runs(task_id)) == 1
        assert app.AsyncResult(task_id).get(timeout=10) == 5
        return
    poll(lambda: metrics.COUNTERS.get("suppressed_duplicate", where=state.value) == 1)
    assert runs(task_id) == []
    assert app.AsyncResult(task_id).state == "PENDING"  # nothing stored for it
    assert store_of(app).get(JobRef.submitted(task_id)) == before


def test_same_task_id_twice_is_one_job(app: Celery) -> None:
    task = app.tasks["t.add"]
    first = task.apply_async((4, 4), task_id="fixed-id")
    second = task.apply_async((4, 4), task_id="fixed-id")
    assert first.id == second.id == "fixed-id"
    poll(lambda: job_state(app, "fixed-id") is State.SUCCEEDED)
    with pytest.raises(JobConflict):
        task.apply_async((5, 5), task_id="fixed-id")
    poll(lambda: metrics.COUNTERS.get("dispatched") >= 1)
    assert len(runs("fixed-id")) == 1


def test_retry_is_one_run_per_attempt_even_with_stale_redelivery(app: Celery) -> None:
    result = app.tasks["t.retry"].delay(2)
    poll(lambda: job_state(app, result.id) is State.SUCCEEDED)
    # The attempt-0 message delivered again after the retries: refused (stale attempt)
    job = store_of(app).get(JobRef.submitted(result.id))
    assert job is not None and job.attempt == 2
    stale = message_headers(job, "gate") | {"exactonce_attempt": 0}
    app.send_task("t.retry", args=(2,), task_id=result.id, headers=stale, retries=0)
    poll(lambda: metrics.COUNTERS.get("suppressed_duplicate") >= 1)
    assert [row[2] for row in runs(result.id)] == [0, 1, 2]


def test_autoretry_is_one_run_per_attempt(app: Celery) -> None:
    result = app.tasks["t.auto"].delay()
    poll(lambda: job_state(app, result.id) is State.SUCCEEDED)
    assert [row[2] for row in runs(result.id)] == [0, 1, 2]


def test_a_completion_write_that_fails_once_is_retried(app: Celery) -> None:
    result = app.tasks["t.outage"].delay(1)
    poll(lambda: job_state(app, result.id) is State.SUCCEEDED)
    assert result.get(timeout=10) == "done"
    assert len(runs(result.id)) == 1
    assert metrics.COUNTERS.get("completion_write_failed") == 0


def test_a_completion_write_that_keeps_failing_never_runs_the_body_again(app: Celery) -> None:
    # Given a body that succeeded, whose every completion write then failed
    result = app.tasks["t.outage"].delay(1_000)
    poll(lambda: metrics.COUNTERS.get("completion_write_failed", state="SUCCEEDED") == 1)
    # Then the result is kept, the job is left RUNNING for the reconciler to settle
    assert result.get(timeout=10) == "done"
    store_of(app).fail_transitions = 0
    assert job_state(app, result.id) is State.RUNNING
    # and a redelivery does not run the body again
    republish(app, result.id)
    poll(lambda: metrics.COUNTERS.get("suppressed_duplicate") >= 1)
    assert len(runs(result.id)) == 1


def test_store_down_at_the_gate_runs_nothing_until_it_returns(app: Celery) -> None:
    task = app.tasks["t.add"]
    task.exactonce_gate_timeout = 0.2
    try:
        store = store_of(app)
        result = task.apply_async((7, 7))  # dispatched while the store is up
        store.down = True
        poll(lambda: metrics.COUNTERS.get("fail_closed", phase="gate_read") >= 1 or runs(result.id))
        assert runs(result.id) == []
        store.down = False
        poll(lambda: job_state(app, result.id) is State.SUCCEEDED)
        assert len(runs(result.id)) == 1
    finally:
        task.exactonce_gate_timeout = 30.0


def test_foreign_message_is_adopted_once(app: Celery) -> None:
    app.send_task("t.add", args=(9, 9), task_id="foreign-1")
    app.send_task("t.add", args=(9, 9), task_id="foreign-1")
    poll(lambda: job_state(app, "foreign-1") is State.SUCCEEDED)
    poll(lambda: metrics.COUNTERS.get("suppressed_duplicate") >= 1)
    assert len(runs("foreign-1")) == 1


def test_message_with_our_headers_but_no_record_does_not_run(app: Celery) -> None:
    headers = {"exactonce_job_id": "lost-1", "exactonce_attempt": 0, "idempotency_key": "x"}
    app.send_task("t.add", args=(1, 2), task_id="lost-1", headers=headers)
    poll(lambda: metrics.COUNTERS.get("record_lost") == 1)
    assert runs("lost-1") == []


def test_record_of_another_task_is_a_conflict(app: Celery) -> None:
    result = app.tasks["t.other"].delay()
    poll(lambda: job_state(app, result.id) is State.SUCCEEDED)
    job = store_of(app).get(JobRef.submitted(result.id))
    assert job is not None
    app.send_task("t.add", args=(1, 1), task_id=result.id, headers=message_headers(job, "gate"))
    poll(lambda: metrics.COUNTERS.get("gate_conflict") == 1)
    assert [row[0] for row in runs(result.id)] == ["t.other"]


def test_reject_on_worker_lost_is_refused_on_a_gated_task() -> None:
    app = make_app()

    @app.task(base=ExactOnceTask, shared=False, reject_on_worker_lost=True, name="t.bad")
    def bad() -> None: ...

    from celery_exactonce.task.gate import validate_gated_task

    with pytest.raises(ConfigurationError, match="reject_on_worker_lost"):
        validate_gated_task(app.tasks["t.bad"])


def test_ambiguous_submit_raises_and_resubmitting_runs_once(app: Celery) -> None:
    store = store_of(app)
    store.lose_next_create = True
    with pytest.raises(SubmitAmbiguous) as info:
        app.tasks["t.add"].apply_async((3, 4), task_id="amb-1")
    assert info.value.task_id == "amb-1"
    store.down = False
    # the caller resubmits the same id: the existing job is returned, run once
    app.tasks["t.add"].apply_async((3, 4), task_id="amb-1")
    poll(lambda: (j := store.get(JobRef.submitted("amb-1"))) is not None and j.terminal)
    job = store.get(JobRef.submitted("amb-1"))
    assert job is not None and job.state is State.SUCCEEDED
    assert len(runs("amb-1")) == 1


def test_countdown_waits_pending_in_the_store_then_runs_once(app: Celery) -> None:
    # Given a gated task submitted with a countdown
    result = app.tasks["t.add"].apply_async((3, 4), countdown=0.5)
    # Then it waits PENDING in the store (no ETA message on the broker)
    job = store_of(app).get(JobRef.submitted(result.id))
    assert job is not None and job.state is State.PENDING and job.run_at is not None
    assert runs(result.id) == []
    # and the beat sweep dispatches it once it is due: it runs once
    poll(lambda: job_state(app, result.id) is State.SUCCEEDED)
    assert len(runs(result.id)) == 1
    # A resubmission of the fired task_id is not run again
    app.tasks["t.add"].apply_async((3, 4), task_id=result.id, countdown=0.1)
    assert job_state(app, result.id) is State.SUCCEEDED


def test_cancel_before_run_at_never_runs(app: Celery) -> None:
    result = app.tasks["t.add"].apply_async((1, 1), countdown=1.0)
    assert cancel(result.id, app=app) is True
    assert job_state(app, result.id) is State.CANCELLED
    assert cancel(result.id, app=app) is False  # already cancelled: nothing to do
    # A job submitted after it runs to completion: the sweep saw the cancelled one and skipped it
    later = app.tasks["t.add"].apply_async((2, 2), countdown=1.2)
    poll(lambda: job_state(app, later.id) is State.SUCCEEDED)
    assert runs(result.id) == []
    assert cancel(later.id, app=app) is False  # dispatched and done: not cancellable
    assert cancel("never-submitted", app=app) is False


class _Printable(logging.Filter):
    """Escapes lone surrogates in log records: pytest-xdist cannot send them to its controller."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        record.msg, record.args = text.encode("utf-8", "backslashreplace").decode(), ()
        if record.exc_text:
            record.exc_text = record.exc_text.encode("utf-8", "backslashreplace").decode()
        record.exc_info = None
        return True


@pytest.fixture
def printable_logs() -> Iterator[None]:
    handlers = list(logging.getLogger().handlers)
    printable = _Printable()
    for handler in handlers:
        handler.addFilter(printable)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(printable)


def test_a_failure_whose_message_cannot_be_stored_still_ends_failed(
    app: Celery, printable_logs: None
) -> None:
    """A body raising with a non-UTF-8 file name in its message (issue 11 item 14).

    Fails before the fix: the reason went to the store as it was (PostgreSQL,
    SQLite and Redis refuse it: the job stayed RUNNING until its timeout).
    """
    result = app.tasks["t.badname"].delay()
    poll(lambda: job_state(app, result.id) is State.FAILED)
    job = store_of(app).get(JobRef.submitted(result.id))
    assert job is not None
    assert job.reason == "OSError: cannot read report-\ufffd.csv"
    # The task's own exception is what Celery records
    poll(lambda: result.state == "FAILURE")
    assert isinstance(result.result, OSError) and NON_UTF8_NAME in str(result.result)


def test_kombu_typed_arguments_reach_the_body_as_plain_celery_sends_them(app: Celery) -> None:
    """bytes, datetime, UUID and Decimal arguments of ``apply_async``.

    Fails before the fix: ``InvalidPayload`` from ``apply_async`` (not JSON).
    """
    result = app.tasks["t.echo"].apply_async(TYPED_ARGS, {"when": TYPED_ARGS[1]})
    poll(lambda: job_state(app, result.id) is State.SUCCEEDED)
    plain = app.send_task("t.echo", args=TYPED_ARGS, kwargs={"when": TYPED_ARGS[1]})
    poll(lambda: runs(plain.id) or None)
    ((*_, gated_args),) = runs(result.id)
    ((*_, plain_args),) = runs(plain.id)
    assert gated_args == plain_args == (TYPED_ARGS, {"when": TYPED_ARGS[1]})
