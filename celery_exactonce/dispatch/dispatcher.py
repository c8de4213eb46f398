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

With a signing key (:mod:`celery_exactonce.stores.signing`), a record whose signature
does not verify is never published: it ends ``FAILED`` and is counted
(``signature_invalid``). The check runs before the ``DISPATCHED`` write and
again on the very record about to be published.

Here: :class:`Dispatcher`, the ``DISPATCHED`` write, the publish and the
enqueue's entry. Not here: what each failure writes and counts, the
rollback among them, and the dispatcher's best-effort writes on its own
``rev`` (:mod:`~celery_exactonce.dispatch.failures`, its base); the one-step
submit itself (:mod:`~celery_exactonce.dispatch.one_step`) and the one-write
submit (:mod:`~celery_exactonce.dispatch.one_write`); the background retries
(:mod:`~celery_exactonce.dispatch.retrier`); what a dispatch did
(:mod:`~celery_exactonce.dispatch.outcomes`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from celery_exactonce.core import exceptions, jobs
from celery_exactonce.core.jobs import Job, TransitionStatus
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import Action, Lease, NewJob, Transition
from celery_exactonce.dispatch import messages
from celery_exactonce.dispatch.failures import DispatchFailures
from celery_exactonce.dispatch.messages import GATED_OPTION
from celery_exactonce.dispatch.one_step import OneStep
from celery_exactonce.dispatch.one_write import Built, OneWrite
from celery_exactonce.dispatch.outcomes import DispatchResult, Enqueued, Outcome
from celery_exactonce.dispatch.publisher import Publisher, PublishFailed
from celery_exactonce.dispatch.retrier import Retrier
from celery_exactonce.observe import metrics
from celery_exactonce.stores import settle, signing
from celery_exactonce.stores.base import StateStore

#: The ``reason`` of beat's dispatch of the occurrences its tick claimed: the one
#: dispatch logged at info, one "Sending due task" line per occurrence, as stock beat.
BEAT_REASON = "beat"

#: The states a dispatch takes a job from; a republish (:meth:`Dispatcher.dispatch`) also
#: takes a gated job ``DISPATCHED`` whose message nothing proves left.
_DISPATCHABLE = frozenset({State.SCHEDULED})
_REPUBLISHED = frozenset({State.SCHEDULED, State.DISPATCHED})

#: Jobs per ``DISPATCHED`` write in :meth:`Dispatcher.dispatch_many`: at most this
#: many are left ``DISPATCHED`` without a message if the process dies mid-chunk.
DISPATCH_CHUNK = 32


class Dispatcher(DispatchFailures):
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
        self._one_step = OneStep(self)
        self._one_write = OneWrite(self)

    def dispatch(
        self,
        job: Job,
        *,
        reason: str = "dispatch",
        retry: bool = True,
        lease: Lease | None = None,
        call: Mapping[str, Any] | None = None,
        action: Action | None = None,
        republish: bool = False,
    ) -> DispatchResult:
        """CAS ``job`` (as listed, ``SCHEDULED``) to ``DISPATCHED`` and publish it.

        With ``retry`` (and a :class:`Retrier`), a dispatch that failed closed
        or was rolled back is retried later in the background. With ``lease``
        (the reconciler), the CAS also requires that lease: a lost lease is
        ``LOST`` with a :class:`~celery_exactonce.core.exceptions.LeaseLost` error.
        ``call`` holds the submitting caller's :data:`CALL_OPTIONS`; ``action``
        the reconciler's action the dispatch is (recorded in the history).
        With ``republish`` a job listed ``DISPATCHED`` is published again, after
        a CAS ``DISPATCHED → DISPATCHED`` on its ``rev`` (a resubmission of a
        gated job whose message nothing proves left: the gate drops a copy).
        """
        return self.dispatch_many(
            [job],
            reason=reason,
            retry=retry,
            lease=lease,
            call=call,
            action=action,
            republish=republish,
        )[0]

    def dispatch_many(
        self,
        listed: Sequence[Job],
        *,
        reason: str = "dispatch",
        retry: bool = True,
        lease: Lease | None = None,
        call: Mapping[str, Any] | None = None,
        action: Action | None = None,
        republish: bool = False,
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
                chunk = listed[start : start + DISPATCH_CHUNK]
                sources = _REPUBLISHED if republish else _DISPATCHABLE
                done, published = self._dispatch_chunk(
                    chunk, reason, lease, call or {}, action, sources
                )
                results += done
                self._write_many(published, State.PUBLISHED, "publish returned")
        if retry and self.retrier is not None:
            for job, result in zip(listed, results, strict=True):
                if result.outcome in (Outcome.FAIL_CLOSED, Outcome.ROLLED_BACK):
                    self.retrier.schedule(job.ref)
        return results

    def _dispatch_chunk(
        self,
        listed: Sequence[Job],
        reason: str,
        lease: Lease | None,
        call: Mapping[str, Any],
        action: Action | None,
        sources: frozenset[State] = frozenset({State.SCHEDULED}),
    ) -> tuple[list[DispatchResult], list[Job]]:
        """Write ``DISPATCHED`` and publish one chunk; the results, and the plain jobs sent."""
        results: list[DispatchResult | None] = [None] * len(listed)
        writes: list[tuple[int, Job, Transition]] = []
        for i, job in enumerate(listed):
            if job.state not in sources:
                results[i] = DispatchResult(Outcome.LOST, job)
            elif self.signer is not None and (problem := self.signer.problem(job)):
                results[i] = self._refuse(job, problem)
            else:
                request = Transition(
                    State.DISPATCHED,
                    frozenset({job.state}),
                    node=self.node,
                    reason=reason,
                    rev=job.rev,
                    lease=lease,
                    action=action,
                )
                writes.append((i, job, request))
        sent: list[tuple[int, Job]] = []
        for i, written in self._write_dispatched(writes):
            if isinstance(written, DispatchResult):
                results[i] = written
                continue
            results[i] = result = self._send(written, call, reason)
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
        return done, published

    def _write_dispatched(
        self, writes: Sequence[tuple[int, Job, Transition]]
    ) -> list[tuple[int, Job | DispatchResult]]:
        """The batched ``DISPATCHED`` CAS: per write, the record to publish, or the outcome.

        A write that errored and whose read-back does not show it applied
        fails closed; a lost CAS is ``LOST``. Either way nothing is published.

        The CAS is brief: the store does not send the record back. A CAS on the
        listed ``rev`` that applied turned exactly that record into
        :func:`~celery_exactonce.core.jobs.apply_transition` of it (the store runs
        the same function), so the record to publish is computed here; only
        its times are this process's estimate (the listed ``touched_at``).
        """
        if not writes:
            return []
        written = settle.transition_many(
            self.store, [(job.ref, req) for _, job, req in writes], brief=True
        )
        out: list[tuple[int, Job | DispatchResult]] = []
        for (i, job, request), reply in zip(writes, written, strict=True):
            if reply.applied:
                out.append((i, reply.job or jobs.apply_transition(job, request, job.touched_at)))
                continue
            if reply.error is not None:
                self._fail_closed("dispatched_write", job, reply.error)
                out.append((i, DispatchResult(Outcome.FAIL_CLOSED, job, reply.error)))
                continue
            metrics.event(
                "dispatch_lost",
                f"job {job.ref} already taken ({reply.status and reply.status.value})",
                level=logging.DEBUG,
                job_id=job.ref.id,
                task=job.task,
            )
            lost = reply.status is TransitionStatus.LEASE_LOST
            error = (
                exceptions.LeaseLost(f"lease lost before dispatching {job.ref}") if lost else None
            )
            out.append((i, DispatchResult(Outcome.LOST, reply.job, error)))
        return out

    def enqueue(
        self, new: NewJob, *, reason: str = "dispatch", call: Mapping[str, Any] | None = None
    ) -> Enqueued | None:
        """Create ``new`` already ``DISPATCHED`` in one store write, and publish it.

        With its message in the same call where the broker shares a Redis
        store's server (:class:`OneStep`); else, on a store whose ``enqueue``
        writes the record alone (the SQL stores; the Redis store with another
        broker), the record is written ``DISPATCHED`` by one statement or
        script, then published as :meth:`dispatch` publishes (a definite
        failure rolls it back to ``SCHEDULED``, retried in the background).
        ``None`` where neither can be done: the caller takes the general
        path, :meth:`dispatch` after a create.

        Raises :class:`~celery_exactonce.core.exceptions.StoreError` when the
        write's outcome is unknown (the answer was lost and the record could
        not be read back, or was not there yet).
        """
        enqueued = self._one_step.enqueue(new, reason=reason, call=call)
        if enqueued is not None:
            return enqueued
        return self._one_write.enqueue(new, reason, call or {})

    def publish(self, job: Job, *, extra: Mapping[str, Any] | None = None) -> DispatchResult:
        """Publish ``job``, which this caller just wrote ``DISPATCHED`` (its ``rev`` is ours).

        ``extra`` holds publish options for this publish only (a retry's ``eta``).
        """
        result = self._send(job, extra or {})
        if result.outcome is Outcome.PUBLISHED and not job.options.get(GATED_OPTION):
            self._write(job, State.PUBLISHED, "publish returned")
        return result

    def _send(
        self, job: Job, extra: Mapping[str, Any], reason: str = "", built: Built = None
    ) -> DispatchResult:
        """Publish a job we hold ``DISPATCHED``; every outcome but the ``PUBLISHED`` write.

        ``built``: its message built already (:mod:`~celery_exactonce.dispatch.one_write`),
        or why it could not be. A beat tick's dispatch (``reason`` :data:`BEAT_REASON`)
        is logged at info as stock beat logs it; any other at debug.
        """
        if self.signer is not None and (problem := self.signer.problem(job)):
            return self._refuse(job, problem)
        if job.deadline is not None and job.touched_at >= job.deadline:
            self._write(job, State.CANCELLED, "deadline passed before publish")
            metrics.event(
                "dispatch_expired",
                f"job {job.ref} expired before publish",
                job_id=job.ref.id,
                task=job.task,
            )
            expired = getattr(self.publisher, "expired", None)
            if expired is not None:
                expired(job)
            return DispatchResult(Outcome.EXPIRED, job)
        headers = messages.message_headers(job, self.store.namespace) if built is None else {}
        try:
            if isinstance(built, PublishFailed):
                raise built
            sent = self.publisher(job, headers, extra) if built is None else built.send()
        except PublishFailed as exc:
            return self._publish_failed(job, exc)
        if reason == BEAT_REASON:  # stock beat's line, and what names the occurrence
            headers = headers or messages.message_headers(job, self.store.namespace)
            metrics.event(
                "dispatched",
                "Scheduler: Sending due task %s (%s) key=%s fire_time=%s idempotency_key=%s",
                job.entry,
                job.task,
                job.entry,
                headers.get(messages.HEADER_FIRE_TIME),
                headers[messages.HEADER_IDEMPOTENCY_KEY],
                job_id=job.ref.id,
                task=job.task,
                attempt=job.attempt,
                key=job.entry,
            )
        else:
            metrics.event(
                "dispatched",
                "job %s published (attempt %s)",
                job.ref,
                job.attempt,
                level=logging.DEBUG,
                job_id=job.ref.id,
                task=job.task,
                attempt=job.attempt,
            )
        return DispatchResult(Outcome.PUBLISHED, job, sent=sent)

    # -- internals ------------------------------------------------------------------

    def _flushed(self, job: Job, sent: DispatchResult) -> DispatchResult:
        """``sent``, once what the publisher buffered is sent; the failure if that failed."""
        if sent.outcome is Outcome.PUBLISHED:
            try:
                self._flush()
            except PublishFailed as exc:
                return self._publish_failed(job, exc)
        return sent

    def _flush(self) -> None:
        """Send what the publisher buffered (:class:`PublishFailed` if that failed)."""
        flush = getattr(self.publisher, "flush", None)
        if flush is not None:
            flush()
