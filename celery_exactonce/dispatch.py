"""The dispatch path: write ``DISPATCHED`` first, then publish what that write returned.

Beat, the delayed-job sweeper, the reconciler, Celery retries and
``ExactOnceTask.apply_async`` all publish through :class:`Dispatcher` and
nothing else (docs/design/protocol.md, "Dispatch"):

1. CAS ``SCHEDULED → DISPATCHED`` on the job's ``rev``. A write that errors is
   settled by reading back: if the record holds this writer's new ``rev`` the
   write applied and the publish goes ahead; otherwise nothing is published
   (*fail closed*).
2. Publish the payload the CAS returned, with our headers and an ``expires``
   at the job's deadline, kombu's own publish retry off.
3. A failure is *definite* only when nothing can have been sent (the
   connection was refused): CAS back to ``SCHEDULED`` and count a rollback; the
   job is retried later (the reconciler replays stale ``SCHEDULED`` jobs).
   A message that cannot be built (an option ``send_task`` refuses, a payload
   that does not encode) fails before anything is sent: definite and
   permanent, the job ends ``FAILED`` with the reason.
   Anything else is *ambiguous*: the job stays ``DISPATCHED`` and is counted;
   a second copy, if one is ever published, is stopped by the worker gate.
4. A plain job (no gate) ends ``PUBLISHED`` once its publish returned.

With a signing key (:mod:`celery_exactonce.signing`), a record whose signature
does not verify is never published: it ends ``FAILED`` and is counted
(``signature_invalid``). The check runs before the ``DISPATCHED`` write and
again on the very record about to be published.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import errno
import heapq
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

from celery_exactonce import exceptions, jobs, messages, metrics, signing
from celery_exactonce.jobs import Job, JobRef, Lease, Transition, TransitionStatus
from celery_exactonce.states import State
from celery_exactonce.stores.base import StateStore

logger = logging.getLogger(__name__)

#: Job option (stored with the job, never published) telling that the consumer
#: runs the gate for this task. Written by whoever creates the job, from what it
#: knows of the task; every later reader (a beat sweeping delayed jobs, the
#: reconciler) goes by the record, never by its own task registry.
GATED_OPTION = "exactonce_gated"
#: Job option (stored, never published): the task's own reconciler policy as its
#: creator saw it (``exactonce_dispatch_deadline``, ``exactonce_redispatch``...),
#: so a process that does not import the task still applies it.
POLICY_OPTION = "exactonce_policy"

#: Stored job options that are ours and never go to ``send_task``.
INTERNAL_OPTIONS = frozenset({GATED_OPTION, POLICY_OPTION, messages.MESSAGE_ID_OPTION})

#: ``send_task`` keywords that belong to one call (the caller's), never stored:
#: ``result_cls`` builds the result it returns, ``add_to_parent`` adds that result to
#: the worker task that submits (only the submitting process has one).
CALL_OPTIONS = frozenset({"result_cls", "add_to_parent"})

#: Options the dispatch path passes to ``send_task`` itself (or that name a
#: process-local object): a job or beat entry that sets one is refused.
RESERVED_OPTIONS = frozenset(
    {"args", "kwargs", "task_id", "producer", "retries", "retry", "name", "connection",
     "router", "result_cls", "publisher"}
)  # fmt: skip

#: Jobs per ``DISPATCHED`` write in :meth:`Dispatcher.dispatch_many`: at most this
#: many are left ``DISPATCHED`` without a message if the process dies mid-chunk.
DISPATCH_CHUNK = 32
#: Transport commands a publish batch may buffer before kombu flushes it by itself:
#: far above a chunk's (a message is one to a few), so only :meth:`CeleryPublisher.flush`
#: sends, and a failure is known to concern exactly the chunk.
PUBLISH_BUFFER_MAX = 100_000

#: How long a writer keeps trying to read back a write whose answer was lost.
READ_BACK_TRIES = 3
READ_BACK_DELAY = 0.05


class Outcome(str, enum.Enum):
    """What one dispatch did. Every value but ``PUBLISHED`` and ``LOST`` is counted."""

    PUBLISHED = "published"
    """Handed to the broker (a plain job is now ``PUBLISHED``, a gated one ``DISPATCHED``)."""
    LOST = "lost"
    """The CAS lost: another dispatcher, a cancel or the reconciler moved the job first."""
    FAIL_CLOSED = "fail_closed"
    """The store could not be written or read back: nothing was published."""
    ROLLED_BACK = "rolled_back"
    """The publish failed definitely; the job is ``SCHEDULED`` again, to be retried."""
    ROLLBACK_FAILED = "rollback_failed"
    """The publish failed definitely and the rollback write failed too (reported)."""
    AMBIGUOUS = "ambiguous"
    """The broker may or may not have the message; the job stays ``DISPATCHED``."""
    FAILED = "failed"
    """Permanent: unknown task or unpublishable payload; the job is ``FAILED``."""
    EXPIRED = "expired"
    """Past its deadline before it could be published; the job is ``CANCELLED``."""


@dataclasses.dataclass(frozen=True)
class DispatchResult:
    outcome: Outcome
    job: Job | None = None
    error: BaseException | None = None
    #: What the publisher returned for a ``PUBLISHED`` job (``send_task``'s ``AsyncResult``).
    sent: Any = None


class PublishFailed(Exception):
    """A publish that did not (certainly) reach the broker."""

    def __init__(self, message: str, *, definite: bool, permanent: bool = False) -> None:
        super().__init__(message)
        self.definite = definite
        self.permanent = permanent


class Publisher(Protocol):
    """Sends one job's message; returns what the caller may hand on (``send_task``'s result).

    ``extra`` holds options of this publish only (:data:`CALL_OPTIONS` among them).
    Raises :class:`PublishFailed` on failure.
    """

    def __call__(self, job: Job, headers: Mapping[str, Any], extra: Mapping[str, Any]) -> Any: ...


def check_options(options: Mapping[str, Any], *, context: str) -> None:
    """Refuse publish options the dispatch path cannot pass on; ``InvalidPayload`` naming it.

    ``send_task`` keywords the dispatch sets itself (``retry``: kombu's publish
    retry is always off; ``retries``: the job's attempt; ``task_id``...) and a
    ``headers`` that is not a dict of string keys. Whether each value can be
    stored as JSON is checked when the job is built (:class:`~celery_exactonce.jobs.NewJob`).
    """
    reserved = sorted(RESERVED_OPTIONS.intersection(options))
    if reserved:
        raise exceptions.InvalidPayload(
            f"{context}: option {reserved[0]!r} cannot be set: the dispatch path sets it itself "
            f"(options it refuses: {', '.join(sorted(RESERVED_OPTIONS))})"
        )
    headers = options.get("headers")
    if headers is not None and (
        not isinstance(headers, Mapping) or not all(isinstance(k, str) for k in headers)
    ):
        raise exceptions.InvalidPayload(
            f"{context}: option 'headers' must be a dict with string keys, "
            f"got {type(headers).__name__}"
        )


def _reached_the_transport(exc: BaseException) -> bool:
    """Whether ``exc`` was raised once kombu was handing the message over (``Producer._publish``).

    An error raised before that (Celery building the message, a keyword
    ``send_task`` refuses) cannot have sent anything.
    """
    messaging = os.path.join("kombu", "messaging.py")
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "_publish" and code.co_filename.endswith(messaging):
            return True
        tb = tb.tb_next
    return False


def connection_refused(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a refused or unresolvable connect.

    Only such a failure proves that nothing was sent; every other publish
    error may have left a message on the broker.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (ConnectionRefusedError, socket.gaierror)):
            return True
        if isinstance(current, OSError) and current.errno == errno.ECONNREFUSED:
            return True
        if "Connection refused" in str(current) and "connecting to" in str(current):
            return True  # redis-py's connect error, which keeps no errno
        current = current.__cause__ or current.__context__
    return False


class CeleryPublisher:
    """Publishes through the Celery app's producer pool, kombu's retry off.

    Inside :meth:`batch`, every publish of this thread goes through one
    producer, acquired and connection-checked once for the whole batch; where
    the transport batches publishes (kombu's ``Producer.batch``: the Redis
    transport pipelines them), messages are buffered until :meth:`flush`,
    which sends them in one round trip and says whether they landed.
    ``timeout`` (``exactonce_publish_timeout``) bounds each publish where the
    transport supports it; one that times out counts as ambiguous.
    """

    def __init__(self, app: Any, *, timeout: float | None = None) -> None:
        self.app = app
        self.timeout = timeout
        self._local = threading.local()

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Publish the calls made inside on one producer from the pool.

        Messages still buffered at the end are flushed (:class:`PublishFailed`
        if that fails), or discarded, never half-sent, if the block raised.
        """
        local = self._local
        if getattr(local, "producer", None) is not None:
            yield  # nested: the outer batch's producer serves
            return
        with self.app.producer_or_acquire(None) as producer:
            local.producer, local.checked, local.connect_error = producer, False, None
            local.buffer = None
            try:
                yield
                self.flush()
            finally:
                buffer, local.buffer = local.buffer, None
                local.producer = local.connect_error = None
                if buffer is not None:
                    error = RuntimeError("publish batch abandoned")
                    buffer.__exit__(RuntimeError, error, None)  # discards

    def flush(self) -> None:
        """Send the messages this thread's batch buffered; :class:`PublishFailed` if not all did.

        Nothing buffered (no batch, or a transport that publishes at once): nothing to do.
        """
        local = self._local
        buffer = getattr(local, "buffer", None)
        if buffer is None:
            return
        local.buffer = None
        try:
            buffer.__exit__(None, None, None)  # kombu flushes on a clean exit
        except Exception as exc:
            local.checked = False
            raise PublishFailed(
                f"batched publish failed: {exc}", definite=connection_refused(exc)
            ) from exc

    def __call__(self, job: Job, headers: Mapping[str, Any], extra: Mapping[str, Any]) -> Any:
        call = {name: extra[name] for name in CALL_OPTIONS.intersection(extra)}
        try:
            options = self._options(
                job, headers, {k: v for k, v in extra.items() if k not in CALL_OPTIONS}
            )
        except (TypeError, ValueError) as exc:  # before anything is sent
            raise PublishFailed(
                f"cannot build the message: {exc}", definite=True, permanent=True
            ) from exc
        options.update(call)
        options.setdefault("add_to_parent", False)  # only a submitting worker task has a parent
        if getattr(self._local, "producer", None) is None:
            with self.batch():
                return self._publish(job, options)
        return self._publish(job, options)

    def _options(
        self, job: Job, headers: Mapping[str, Any], extra: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The ``send_task`` options of one publish: stored ones decoded, ours added."""
        options = {k: v for k, v in {**job.options, **extra}.items() if k not in INTERNAL_OPTIONS}
        check_options(options, context=f"job {job.ref}")
        options = dict(jobs.decode_payload(options))
        options["headers"] = {**dict(options.get("headers") or {}), **headers}
        if job.deadline is not None:
            options["expires"] = job.deadline
        if job.run_at is not None:
            # The ``eta`` the job waited for in the store (it is due now): the worker
            # shows it as ``request.eta``, as it would the ETA of a plain message.
            options.setdefault("eta", job.run_at)
        if self.timeout is not None:
            options.setdefault("timeout", self.timeout)
        return options

    def _publish(self, job: Job, options: dict[str, Any]) -> Any:
        """Send (or buffer) on the batch's producer; connect first if nothing was sent on it yet.

        The connect is checked (kombu's retries off) before the first publish
        and again after any failed one, so a refused connection is told apart
        from a publish that may have landed.
        """
        from kombu.exceptions import EncodeError

        local = self._local
        if not local.checked:
            local.connect_error, local.checked = self._connect(local.producer), True
        if local.connect_error is not None:
            error = local.connect_error
            raise PublishFailed(f"connect failed: {error}", definite=True) from error
        if local.buffer is None and hasattr(local.producer, "batch"):  # kombu >= 5.7
            buffer = local.producer.batch(max_size=PUBLISH_BUFFER_MAX)
            buffer.__enter__()
            local.buffer = buffer
        try:
            return self.app.send_task(
                job.task, args=jobs.decode_payload(job.args),
                kwargs=jobs.decode_payload(job.kwargs), task_id=messages.message_task_id(job),
                producer=local.producer, retries=job.attempt, retry=False, **options,
            )  # fmt: skip
        except EncodeError as exc:
            raise PublishFailed(f"cannot encode: {exc}", definite=True, permanent=True) from exc
        except (TypeError, ValueError) as exc:
            if _reached_the_transport(exc):
                local.checked = False
                raise PublishFailed(str(exc), definite=connection_refused(exc)) from exc
            # Celery could not build the message from the stored job: nothing was sent,
            # and no later try would build it either.
            raise PublishFailed(
                f"cannot build the message: {type(exc).__name__}: {exc}",
                definite=True,
                permanent=True,
            ) from exc
        except Exception as exc:
            local.checked = False
            raise PublishFailed(str(exc), definite=connection_refused(exc)) from exc

    def expired(self, job: Job) -> None:
        """Record ``job``, past its deadline and never sent, as a worker records an expired message.

        The result becomes ``REVOKED`` (``TaskRevokedError('expired')``), so a
        caller waiting on it is answered as plain Celery answers it. Best
        effort: a result backend that fails is logged, the job is ``CANCELLED``.
        """
        if job.options.get("ignore_result"):
            return
        try:
            self.app.backend.mark_as_revoked(messages.message_task_id(job), "expired")
        except Exception as exc:
            logger.warning(
                "could not record the expiry of %s in the result backend: %s", job.ref, exc,
                extra={"action": "result_write_failed", "job_id": job.ref.id},
            )  # fmt: skip

    @staticmethod
    def _connect(producer: Any) -> Exception | None:
        """Connect ``producer`` without kombu's retries; the error if that failed."""
        try:
            producer.connection.ensure_connection(max_retries=0)
        except Exception as exc:
            return exc
        return None


class Retrier:
    """Retries, in a background thread, dispatches that failed closed or were rolled back.

    Each job is retried with exponential back-off (``first_delay`` doubling up
    to ``max_delay``) for at most ``give_up_after`` seconds; past that, or if
    this process exits, the reconciler replays the ``SCHEDULED`` job. A retry
    re-reads the record and dispatches it only while it is still
    ``SCHEDULED``, so it never publishes a job someone else has moved on.
    """

    def __init__(
        self, first_delay: float = 1.0, max_delay: float = 30.0, give_up_after: float = 300.0
    ) -> None:
        self.first_delay = first_delay
        self.max_delay = max_delay
        self.give_up_after = give_up_after
        self._lock = threading.Condition()
        self._queue: list[tuple[float, int, JobRef, float, float]] = []
        self._seq = 0
        self._thread: threading.Thread | None = None
        self._dispatcher: Dispatcher | None = None

    def bind(self, dispatcher: Dispatcher) -> None:
        self._dispatcher = dispatcher

    def schedule(
        self, ref: JobRef, delay: float | None = None, *, started: float | None = None
    ) -> None:
        """Retry the dispatch of ``ref`` after ``delay`` seconds."""
        now = time.monotonic()
        delay = self.first_delay if delay is None else delay
        with self._lock:
            self._seq += 1
            heapq.heappush(self._queue, (now + delay, self._seq, ref, delay, started or now))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="exactonce-dispatch-retry", daemon=True
                )
                self._thread.start()
            self._lock.notify()

    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue or self._queue[0][0] > time.monotonic():
                    timeout = self._queue[0][0] - time.monotonic() if self._queue else 60.0
                    if not self._lock.wait(timeout=max(timeout, 0.0)) and not self._queue:
                        return  # idle for a minute: the thread ends, schedule() restarts it
                _, _, ref, delay, started = heapq.heappop(self._queue)
            self._retry(ref, delay, started)

    def _retry(self, ref: JobRef, delay: float, started: float) -> None:
        dispatcher = self._dispatcher
        if dispatcher is None:
            return
        try:
            job = dispatcher.store.get(ref)
        except exceptions.StoreError:
            job = None
            outcome = Outcome.FAIL_CLOSED
        else:
            if job is None or job.state is not State.SCHEDULED:
                return
            outcome = dispatcher.dispatch(job, reason="dispatch retry", retry=False).outcome
        if outcome in (Outcome.FAIL_CLOSED, Outcome.ROLLED_BACK):
            if time.monotonic() - started + delay < self.give_up_after:
                self.schedule(ref, min(delay * 2, self.max_delay), started=started)
            else:
                logger.warning(
                    "gave up retrying the dispatch of %s; the reconciler replays it", ref,
                    extra={"action": "dispatch_retry_gave_up", "job_id": ref.id},
                )  # fmt: skip


class Dispatcher:
    """Moves ``SCHEDULED`` jobs to the broker, at most once per dispatch decision."""

    def __init__(
        self,
        store: StateStore,
        publisher: Publisher,
        *,
        node: str,
        retrier: Retrier | None = None,
        signer: signing.Signer | None = None,
    ) -> None:
        self.store = store
        self.publisher = publisher
        self.node = node
        self.retrier = retrier
        #: Verifies every record before it is published (``exactonce_signing_key``).
        self.signer = signer
        if retrier is not None:
            retrier.bind(self)

    def dispatch(
        self,
        job: Job,
        *,
        reason: str = "dispatch",
        retry: bool = True,
        lease: Lease | None = None,
        call: Mapping[str, Any] | None = None,
    ) -> DispatchResult:
        """CAS ``job`` (as listed, ``SCHEDULED``) to ``DISPATCHED`` and publish it.

        With ``retry`` (and a :class:`Retrier`), a dispatch that failed closed
        or was rolled back is retried later in the background. With ``lease``
        (the reconciler), the CAS also requires that lease: a lost lease is
        ``LOST`` with a :class:`~celery_exactonce.exceptions.LeaseLost` error.
        ``call`` holds the submitting caller's :data:`CALL_OPTIONS`.
        """
        return self.dispatch_many([job], reason=reason, retry=retry, lease=lease, call=call)[0]

    def dispatch_many(
        self,
        listed: Sequence[Job],
        *,
        reason: str = "dispatch",
        retry: bool = True,
        lease: Lease | None = None,
        call: Mapping[str, Any] | None = None,
    ) -> list[DispatchResult]:
        """:meth:`dispatch` for each job, its store writes batched; results in order.

        In chunks of :data:`DISPATCH_CHUNK`: one batched ``DISPATCHED`` write,
        one publish each, one batched ``PUBLISHED`` write for the plain jobs:
        the same steps and guarantees as :meth:`dispatch`,
        per job, in fewer round trips. The chunk bounds what a SIGKILL between
        the write and the publishes can leave ``DISPATCHED`` with no message.
        """
        results: list[DispatchResult] = []
        batch = getattr(self.publisher, "batch", None)  # CeleryPublisher: one producer
        with batch() if batch is not None else contextlib.nullcontext():
            for start in range(0, len(listed), DISPATCH_CHUNK):
                done, published = self._dispatch_chunk(
                    listed[start : start + DISPATCH_CHUNK], reason, lease, call or {}
                )
                results += done
                self._write_many(published, State.PUBLISHED, "publish returned")
        if retry and self.retrier is not None:
            for job, result in zip(listed, results, strict=True):
                if result.outcome in (Outcome.FAIL_CLOSED, Outcome.ROLLED_BACK):
                    self.retrier.schedule(job.ref)
        return results

    def _dispatch_chunk(
        self, listed: Sequence[Job], reason: str, lease: Lease | None, call: Mapping[str, Any]
    ) -> tuple[list[DispatchResult], list[Job]]:
        """Write ``DISPATCHED`` and publish one chunk; the results, and the plain jobs sent."""
        results: list[DispatchResult | None] = [None] * len(listed)
        writes: list[tuple[int, Job, Transition]] = []
        for i, job in enumerate(listed):
            if job.state is not State.SCHEDULED:
                results[i] = DispatchResult(Outcome.LOST, job)
            elif self.signer is not None and (problem := self.signer.problem(job)):
                results[i] = self._refuse(job, problem)
            else:
                request = Transition(
                    State.DISPATCHED, frozenset({State.SCHEDULED}), node=self.node,
                    reason=reason, rev=job.rev, lease=lease,
                )  # fmt: skip
                writes.append((i, job, request))
        sent: list[tuple[int, Job]] = []
        for i, written in self._write_dispatched(writes):
            if isinstance(written, DispatchResult):
                results[i] = written
                continue
            results[i] = result = self._send(written, call)
            if result.outcome is Outcome.PUBLISHED:
                sent.append((i, written))
        try:
            self._flush()
        except PublishFailed as exc:  # none of the chunk's buffered messages is known to land
            for i, written in sent:
                results[i] = self._publish_failed(written, exc)
            sent = []
        published = [job for _, job in sent if not job.options.get(GATED_OPTION)]
        done = [result for result in results if result is not None]
        assert len(done) == len(listed)  # noqa: S101 (every job has exactly one result)
        count = sum(1 for result in done if result.outcome is Outcome.PUBLISHED)
        if count:
            metrics.COUNTERS.incr("dispatched", amount=count)
        return done, published

    def _write_dispatched(
        self, writes: Sequence[tuple[int, Job, Transition]]
    ) -> list[tuple[int, Job | DispatchResult]]:
        """The batched ``DISPATCHED`` CAS: per write, the record to publish, or the outcome.

        A write that errored and whose read-back does not show it applied
        fails closed; a lost CAS is ``LOST``. Either way nothing is published.

        The CAS is brief: the store does not send the record back. A CAS on the
        listed ``rev`` that applied turned exactly that record into
        :func:`~celery_exactonce.jobs.apply_transition` of it (the store runs
        the same function), so the record to publish is computed here; only
        its times are this process's estimate (the listed ``touched_at``).
        """
        if not writes:
            return []
        try:
            replies = self.store.transition_many(
                [(job.ref, req) for _, job, req in writes], brief=True
            )
        except exceptions.StoreError as exc:
            settled: list[tuple[int, Job | DispatchResult]] = []
            for i, job, request in writes:
                dispatched = self.read_back(job.ref, request.new_rev)
                if dispatched is None:
                    self._fail_closed("dispatched_write", job, exc)
                    settled.append((i, DispatchResult(Outcome.FAIL_CLOSED, job, exc)))
                else:
                    settled.append((i, dispatched))
            return settled
        out: list[tuple[int, Job | DispatchResult]] = []
        for (i, job, request), reply in zip(writes, replies, strict=True):
            if reply.applied:
                out.append((i, reply.job or jobs.apply_transition(job, request, job.touched_at)))
                continue
            logger.debug(
                "job %s already taken (%s)", job.ref, reply.status.value,
                extra={"action": "dispatch_lost", "job_id": job.ref.id},
            )  # fmt: skip
            lost = reply.status is TransitionStatus.LEASE_LOST
            error = (
                exceptions.LeaseLost(f"lease lost before dispatching {job.ref}") if lost else None
            )
            out.append((i, DispatchResult(Outcome.LOST, reply.job, error)))
        return out

    def publish(self, job: Job, *, extra: Mapping[str, Any] | None = None) -> DispatchResult:
        """Publish ``job``, which this caller just wrote ``DISPATCHED`` (its ``rev`` is ours).

        ``extra`` holds publish options for this publish only (a retry's ``eta``).
        """
        result = self._send(job, extra or {})
        if result.outcome is Outcome.PUBLISHED:
            metrics.COUNTERS.incr("dispatched")
            if not job.options.get(GATED_OPTION):
                self._write(job, State.PUBLISHED, "publish returned")
        return result

    def _send(self, job: Job, extra: Mapping[str, Any]) -> DispatchResult:
        """Publish a job we hold ``DISPATCHED``; every outcome but the ``PUBLISHED`` write."""
        if self.signer is not None and (problem := self.signer.problem(job)):
            return self._refuse(job, problem)
        if job.deadline is not None and job.touched_at >= job.deadline:
            self._write(job, State.CANCELLED, "deadline passed before publish")
            metrics.event("dispatch_expired", f"job {job.ref} expired before publish",
                          job_id=job.ref.id, task=job.task)  # fmt: skip
            expired = getattr(self.publisher, "expired", None)
            if expired is not None:
                expired(job)
            return DispatchResult(Outcome.EXPIRED, job)
        headers = messages.message_headers(job, self.store.namespace)
        try:
            sent = self.publisher(job, headers, extra)
        except PublishFailed as exc:
            return self._publish_failed(job, exc)
        # Counted by the callers, once per batch: a counter update per message would
        # cost a good share of a publish (the Prometheus counter takes a lock too).
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "job %s published (attempt %s)", job.ref, job.attempt,
                extra={"action": "dispatched", "job_id": job.ref.id, "task": job.task,
                       "attempt": job.attempt},
            )  # fmt: skip
        return DispatchResult(Outcome.PUBLISHED, job, sent=sent)

    def read_back(self, ref: JobRef, op_id: str) -> Job | None:
        """The record if the write ``op_id`` applied and is still the latest; else ``None``.

        ``None`` also when the record cannot be read (bounded tries): the caller
        then publishes nothing, and the reconciler settles the job visibly.
        """
        for attempt in range(READ_BACK_TRIES):
            try:
                job = self.store.get(ref)
            except exceptions.StoreError:
                time.sleep(READ_BACK_DELAY * (2**attempt))
                continue
            return job if job is not None and job.rev == op_id else None
        return None

    # -- internals ------------------------------------------------------------------

    def _rollback(self, job: Job, exc: BaseException) -> Job | None:
        """CAS our ``DISPATCHED`` back to ``SCHEDULED``; ``None`` if that write failed."""
        request = Transition(
            State.SCHEDULED, frozenset({State.DISPATCHED}), node=self.node,
            reason=f"publish failed: {exc}", rev=job.rev,
        )  # fmt: skip
        try:
            result = self.store.transition(job.ref, request)
        except exceptions.StoreError as error:
            result_job = self.read_back(job.ref, request.new_rev)
            if result_job is not None:
                return result_job
            self._rollback_failed(job, error)
            return None
        if not result.applied or result.job is None:
            # Someone (the gate: the message did land after all) moved it on.
            logger.info(
                "rollback of %s found %s", job.ref, result.job.state if result.job else "nothing",
                extra={"action": "rollback_superseded", "job_id": job.ref.id},
            )  # fmt: skip
            return result.job
        metrics.COUNTERS.incr("fail_closed", {"phase": "publish"})
        metrics.event(
            "publish_rolled_back", f"publish of {job.ref} refused ({exc}); back to SCHEDULED",
            level=logging.WARNING, labels={"phase": "publish"}, job_id=job.ref.id, task=job.task,
        )  # fmt: skip
        return result.job

    def _rollback_failed(self, job: Job, exc: BaseException) -> None:
        metrics.COUNTERS.incr("fail_closed", {"phase": "rollback_write"})
        metrics.event(
            "rollback_failed",
            f"publish of {job.ref} failed and the rollback write failed too: "
            "the job stays DISPATCHED for the reconciler",
            level=logging.ERROR, labels={"phase": "rollback_write"}, sentry=True,
            job_id=job.ref.id, task=job.task, exc_info=exc,
        )  # fmt: skip

    def _fail_closed(self, phase: str, job: Job, exc: BaseException) -> None:
        metrics.event(
            "fail_closed", f"store error while dispatching {job.ref} ({phase}): nothing published",
            level=logging.WARNING, labels={"phase": phase}, sentry=True, job_id=job.ref.id,
            task=job.task, exc_info=exc,
        )  # fmt: skip

    def _publish_failed(self, job: Job, exc: PublishFailed) -> DispatchResult:
        """The outcome of a publish of ``job`` (held ``DISPATCHED``) that failed with ``exc``."""
        if exc.permanent:
            return self._fail(self._rollback(job, exc) or job, f"cannot publish: {exc}")
        if not exc.definite:
            metrics.event(
                "publish_ambiguous", f"publish of {job.ref} may or may not have landed: {exc}",
                level=logging.WARNING, job_id=job.ref.id, task=job.task, attempt=job.attempt,
            )  # fmt: skip
            return DispatchResult(Outcome.AMBIGUOUS, job, exc)
        rolled = self._rollback(job, exc)
        if rolled is None:
            return DispatchResult(Outcome.ROLLBACK_FAILED, job, exc)
        return DispatchResult(Outcome.ROLLED_BACK, rolled, exc)

    def _flush(self) -> None:
        """Send what the publisher buffered (:class:`PublishFailed` if that failed)."""
        flush = getattr(self.publisher, "flush", None)
        if flush is not None:
            flush()

    def _fail(
        self,
        job: Job,
        reason: str,
        *,
        action: str = "dispatch_failed",
        message: str | None = None,
        sentry: bool = False,
        held: frozenset[State] = frozenset({State.SCHEDULED}),
    ) -> DispatchResult:
        """End ``job`` ``FAILED`` if it is in a ``held`` state (our rev); counted, never sent."""
        if job.state in held:
            self._write(job, State.FAILED, reason)
        metrics.event(
            action, message or f"job {job.ref} cannot be dispatched: {reason}",
            level=logging.ERROR, sentry=sentry, job_id=job.ref.id, task=job.task,
        )  # fmt: skip
        return DispatchResult(Outcome.FAILED, job)

    def _refuse(self, job: Job, problem: str) -> DispatchResult:
        """A record whose signature does not verify: ``FAILED``, counted, never published."""
        return self._fail(
            job, problem, action="signature_invalid", sentry=True,
            message=f"job {job.ref} ({job.task}) refused: {problem}; not published",
            held=frozenset({State.SCHEDULED, State.DISPATCHED}),
        )  # fmt: skip

    def _write(self, job: Job, state: State, reason: str) -> bool:
        """A best-effort CAS on our own rev; failures are logged (the reconciler settles)."""
        return self._write_many([job], state, reason)[0]

    def _write_many(self, listed: Sequence[Job], state: State, reason: str) -> list[bool]:
        """:meth:`_write` for each job, batched (brief: no record read back); which applied."""
        if not listed:
            return []
        requests = [
            (job.ref, Transition(
                state, frozenset({job.state}), node=self.node,
                reason=reason, rev=job.rev,
            ))
            for job in listed
        ]  # fmt: skip
        try:
            replies = self.store.transition_many(requests, brief=True)
        except exceptions.StoreError as exc:
            for job in listed:
                logger.warning(
                    "could not write %s for %s: %s", state, job.ref, exc,
                    extra={"action": "state_write_failed", "job_id": job.ref.id,
                           "state": str(state)},
                )  # fmt: skip
            return [False] * len(listed)
        return [reply.applied for reply in replies]
