"""How a dispatch fails, and the writes a dispatcher makes on its own ``rev`` after ``DISPATCHED``.

:class:`DispatchFailures` is the base of
:class:`~celery_exactonce.dispatch.dispatcher.Dispatcher` that turns each failure of the
dispatch path into its outcome, its write and its event
(docs/design/protocol.md, "Dispatch"):

* a ``DISPATCHED`` write that errored and was not read back as applied:
  *fail closed*, nothing published (``fail_closed``);
* a publish that failed *definitely* (nothing can have been sent): the
  rollback, a CAS of our ``DISPATCHED`` back to ``SCHEDULED``
  (``publish_rolled_back``; ``rollback_failed`` when that write fails too,
  ``rollback_superseded`` when the gate moved the job on first);
* a publish that failed *permanently* (a message that cannot be built): the
  rollback, then ``FAILED`` with the reason (``dispatch_failed``);
* a publish that may or may not have landed: *ambiguous*, the job stays
  ``DISPATCHED`` (``publish_ambiguous``);
* a record whose signature does not verify: ``FAILED``, never published
  (``signature_invalid``).

And the best-effort writes on the dispatcher's own ``rev`` (``FAILED`` here,
``PUBLISHED`` and ``CANCELLED`` for the dispatcher), batched and brief; one
that fails is logged and left to the reconciler.

Not here: the dispatch itself, the ``DISPATCHED`` write and the publish
(:mod:`~celery_exactonce.dispatch.dispatcher`), what an outcome is
(:mod:`~celery_exactonce.dispatch.outcomes`), how a publish failure is classified
(:mod:`~celery_exactonce.dispatch.publisher`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from celery_exactonce.core import exceptions
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import Transition
from celery_exactonce.dispatch.outcomes import DispatchResult, Outcome
from celery_exactonce.dispatch.publisher import PublishFailed
from celery_exactonce.observe import metrics
from celery_exactonce.stores import settle
from celery_exactonce.stores.base import StateStore


class DispatchFailures:
    """The failures of a dispatch and the dispatcher's own writes; the dispatcher sets
    ``store`` and ``node``."""

    store: StateStore
    node: str

    def _rollback(self, job: Job, exc: BaseException) -> Job | None:
        """CAS our ``DISPATCHED`` back to ``SCHEDULED``; ``None`` if that write failed."""
        request = Transition(
            State.SCHEDULED,
            frozenset({State.DISPATCHED}),
            node=self.node,
            reason=f"publish failed: {exc}",
            rev=job.rev,
        )
        result = settle.transition(self.store, job.ref, request)
        if result.error is not None:  # the answer was lost: applied, as read back, or failed
            if result.applied:
                return result.job
            self._rollback_failed(job, result.error)
            return None
        if not result.applied or result.job is None:
            # Someone (the gate: the message did land after all) moved it on.
            found = result.job.state if result.job else "nothing"
            metrics.event(
                "rollback_superseded",
                f"rollback of {job.ref} found {found}",
                job_id=job.ref.id,
                task=job.task,
            )
            return result.job
        metrics.event(
            "publish_rolled_back",
            f"publish of {job.ref} refused ({exc}); back to SCHEDULED",
            level=logging.WARNING,
            labels={"phase": "publish"},
            also=("fail_closed",),
            job_id=job.ref.id,
            task=job.task,
        )
        return result.job

    def _rollback_failed(self, job: Job, exc: BaseException) -> None:
        metrics.event(
            "rollback_failed",
            f"publish of {job.ref} failed and the rollback write failed too: "
            "the job stays DISPATCHED for the reconciler",
            level=logging.ERROR,
            labels={"phase": "rollback_write"},
            sentry=True,
            also=("fail_closed",),
            job_id=job.ref.id,
            task=job.task,
            key=job.entry,
            state=State.DISPATCHED.value,
            exc_info=exc,
        )

    def _fail_closed(self, phase: str, job: Job, exc: BaseException) -> None:
        metrics.event(
            "fail_closed",
            f"store error while dispatching {job.ref} ({phase}): nothing published",
            level=logging.WARNING,
            labels={"phase": phase},
            sentry=True,
            job_id=job.ref.id,
            task=job.task,
            key=job.entry,
            state=job.state.value,
            exc_info=exc,
        )

    def _publish_failed(self, job: Job, exc: PublishFailed) -> DispatchResult:
        """The outcome of a publish of ``job`` (held ``DISPATCHED``) that failed with ``exc``."""
        if exc.permanent:
            return self._fail(self._rollback(job, exc) or job, f"cannot publish: {exc}")
        if not exc.definite:
            metrics.event(
                "publish_ambiguous",
                f"publish of {job.ref} may or may not have landed: {exc}",
                level=logging.WARNING,
                job_id=job.ref.id,
                task=job.task,
                attempt=job.attempt,
            )
            return DispatchResult(Outcome.AMBIGUOUS, job, exc)
        rolled = self._rollback(job, exc)
        if rolled is None:
            return DispatchResult(Outcome.ROLLBACK_FAILED, job, exc)
        return DispatchResult(Outcome.ROLLED_BACK, rolled, exc)

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
            action,
            message or f"job {job.ref} cannot be dispatched: {reason}",
            level=logging.ERROR,
            sentry=sentry,
            job_id=job.ref.id,
            task=job.task,
        )
        return DispatchResult(Outcome.FAILED, job)

    def _refuse(self, job: Job, problem: str) -> DispatchResult:
        """A record whose signature does not verify: ``FAILED``, counted, never published."""
        return self._fail(
            job,
            problem,
            action="signature_invalid",
            sentry=True,
            message=f"job {job.ref} ({job.task}) refused: {problem}; not published",
            held=frozenset({State.SCHEDULED, State.DISPATCHED}),
        )

    def _write(self, job: Job, state: State, reason: str) -> bool:
        """A best-effort CAS on our own rev; a failure is logged (the reconciler resolves it)."""
        return self._write_many([job], state, reason)[0]

    def _write_many(self, listed: Sequence[Job], state: State, reason: str) -> list[bool]:
        """:meth:`_write` for each job, batched (brief: no record read back); which applied."""
        if not listed:
            return []
        requests = [
            (
                job.ref,
                Transition(
                    state,
                    frozenset({job.state}),
                    node=self.node,
                    reason=reason,
                    rev=job.rev,
                ),
            )
            for job in listed
        ]
        try:
            replies = self.store.transition_many(requests, brief=True)
        except exceptions.StoreError as exc:
            for job in listed:
                metrics.event(
                    "state_write_failed",
                    f"could not write {state} for {job.ref}: {exc}",
                    level=logging.WARNING,
                    job_id=job.ref.id,
                    task=job.task,
                    state=str(state),
                )
            return [False] * len(listed)
        return [reply.applied for reply in replies]
