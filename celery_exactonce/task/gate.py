"""The worker gate: one delivery of a gated task passes it, and runs, or is refused.

Before the body: a CAS ``SCHEDULED/DISPATCHED → RUNNING`` on the message's
attempt, under a run id fresh for this delivery (:meth:`Delivery.enter`). Any
other state (a duplicate) raises Celery's ``Ignore``: the message is acked, no
result is stored and no callback fires. A message from elsewhere (no headers,
no record) is adopted: its job is created ``RUNNING``. A store error never
lets the body run: the gate retries for ``exactonce_gate_timeout``, then
sends the delivery back, carrying the run ids it may have written. After the
body, :meth:`Delivery.finish` writes the outcome on the run id (in a worker,
with the thread's next gate write: :mod:`~celery_exactonce.task.outcomes`).

Not here: what wraps the body (``ExactOnceTask.__call__``), the heartbeats.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from celery import Task
from celery.exceptions import Ignore, Reject, Retry

from celery_exactonce.core import exceptions, formats, refs
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.dispatch import messages
from celery_exactonce.observe import metrics
from celery_exactonce.policy import check_timeouts, task_policy, task_timeouts
from celery_exactonce.runtime import Runtime, config_for, runtime_for
from celery_exactonce.task import outcomes, unique

#: Set (to the attempt) while the gate sends a delivery back unchanged: the
#: task's ``apply_async`` then publishes it as plain Celery would.
raw_republish: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "exactonce_raw", default=None
)


@dataclasses.dataclass
class Delivery:
    """One delivery of a gated task at the gate: what it carries, and its fresh run id."""

    task: Any  # the ExactOnceTask (celery is untyped)
    runtime: Runtime
    ref: refs.JobRef
    attempt: int
    run_id: str
    headers: Mapping[str, Any]
    delivery_info: Mapping[str, Any]

    def enter(
        self, args: Sequence[Any], kwargs: Mapping[str, Any], *, brief: bool = False
    ) -> Job | None:
        """Pass the gate (returning the ``RUNNING`` job this delivery owns) or raise.

        ``run_id`` is this delivery's own token, fresh for it: the body runs only
        once the store confirms the job ``RUNNING`` under it. Raises ``Ignore``
        for a delivery the job does not wait for. With ``brief`` the CAS may
        answer without the record: ``None`` when it applied.

        A write whose answer is lost is settled by reading the record back
        (never by guessing). A delivery that could not settle in time is sent
        back carrying *tickets*: the run ids it (or the deliveries before it)
        may have written. A ticket is not ownership: the next delivery holding
        it must *take over* the run with a CAS from that run id to its own,
        which only one copy of a message can win. A copy the broker refuses
        leaves this delivery trying, another ``exactonce_gate_timeout``, under
        a fresh run id (its old ones tickets), then ``Reject(requeue=True)``.
        """
        runtime, ref, run_id = self.runtime, self.ref, self.run_id
        headers = self.headers
        tickets = frozenset(str(t) for t in headers.get(messages.HEADER_GATE_RUNS) or ())
        self._refuse_newer(tickets)
        gate = self.gate_write("gate")
        deadline = time.monotonic() + self.task.exactonce_gate_timeout
        give_up: float | None = None  # past the deadline: until when to keep trying
        delay = runtime.config.retry_delay_store
        adoption_lost = False
        write: Transition | None = gate  # the next write; None: read the record first
        while True:
            try:
                if write is None:
                    job = runtime.store.get(ref)
                else:  # brief goes through transition_many (with this thread's last outcome)
                    result = outcomes.cas(runtime, ref, write, brief)
                    if result.applied and (brief or result.job is not None):
                        return result.job
                    job = result.job
                if job is None:
                    if adoption_lost or messages.HEADER_JOB_ID in headers:
                        self.refuse(None)
                    adopted = self._adopt(args, kwargs)
                    if adopted is not None:
                        return adopted
                    adoption_lost, write = True, gate  # another delivery adopted it first
                    continue
                if job.state is State.RUNNING and job.run_id == run_id:
                    return job  # our own write applied; its answer was lost
                write = self._next_write(job, tickets, gate)
                if write is None:
                    self.refuse(job)
            except exceptions.StoreError as exc:
                write = None  # what did the store keep? read it back before writing again
                now = time.monotonic()
                if now + delay > deadline:
                    if give_up is None:
                        give_up = now + self.task.exactonce_gate_timeout
                        metrics.event(
                            "fail_closed",
                            f"gate of {ref} cannot reach the store: delivery sent back",
                            level=logging.WARNING,
                            labels={"phase": "gate_read"},
                            sentry=True,
                            job_id=ref.id,
                            task=self.task.name,
                            key=headers.get(messages.HEADER_KEY),
                            exc_info=exc,
                        )
                    tickets |= {run_id}
                    sent = self._send_back(tickets, delay, exc)
                    if sent is not None or now + delay > give_up:
                        raise (sent or self._give_back(exc)) from exc
                    # Refused (the copy may have landed all the same): keep trying, under a
                    # fresh run id; the old ones are tickets, as for any copy (one wins).
                    run_id = self.run_id = refs.new_token()
                    gate = dataclasses.replace(gate, new_run_id=run_id, new_rev=refs.new_token())
                time.sleep(delay)
                delay = min(delay * 2, 10.0)

    def gate_write(self, reason: str) -> Transition:
        """The gate's CAS ``SCHEDULED/DISPATCHED → RUNNING`` on the message's attempt, under
        this delivery's run id."""
        return Transition(
            State.RUNNING,
            frozenset({State.SCHEDULED, State.DISPATCHED}),
            node=self.runtime.node,
            reason=reason,
            attempt=self.attempt,
            task=self.task.name,
            new_run_id=self.run_id,
        )

    def _next_write(self, job: Job, tickets: frozenset[str], gate: Transition) -> Transition | None:
        """The write that would let this delivery run ``job`` as read, or ``None``: not ours."""
        runtime, attempt, run_id = self.runtime, self.attempt, self.run_id
        if job.task != self.task.name or job.attempt != attempt:
            return None
        if job.state in gate.expect:
            return gate  # our earlier write did not apply: try it again
        if job.state is State.RUNNING and job.run_id in tickets:
            return Transition(
                State.RUNNING,
                frozenset({State.RUNNING}),
                node=runtime.node,
                reason="gate: taken over from a delivery sent back",
                attempt=attempt,
                task=self.task.name,
                run_id=job.run_id,
                new_run_id=run_id,
            )
        return None

    def _adopt(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Job | None:
        """A message from elsewhere (no headers, no record): create its job as ``RUNNING``.

        ``None`` if another delivery's create won. A store error propagates:
        the gate reads back whether this create applied.
        """
        runtime, ref, run_id = self.runtime, self.ref, self.run_id
        new = NewJob(
            ref,
            self.task.name,
            State.RUNNING,
            node=runtime.node,
            args=list(args),
            kwargs=dict(kwargs),
            run_id=run_id,
            options={messages.GATED_OPTION: True, messages.POLICY_OPTION: task_policy(self.task)},
            reason="adopted at the gate",
        )
        result = runtime.store.create(new)
        if result.created or (result.job is not None and result.job.rev == new.rev):
            metrics.event(
                "adopted",
                f"adopted {ref} at the gate",
                level=logging.DEBUG,
                job_id=ref.id,
                task=self.task.name,
            )
            return result.job
        return None

    def refuse(self, job: Job | None) -> NoReturn:
        """Ack the delivery unrun (``Ignore``: no result, no callback), counted and logged.

        A redelivery refused is the gate doing its work (debug). A first
        delivery refused means a job that will not run through this message,
        which an operator should see (warning).
        """
        ref, attempt, headers = self.ref, self.attempt, self.headers
        delivery_info = self.delivery_info
        if job is None:
            if messages.HEADER_JOB_ID in headers:
                metrics.event(
                    "record_lost",
                    f"no record for {ref}, whose message carries our "
                    "headers: not run (the store lost it)",
                    level=logging.ERROR,
                    job_id=ref.id,
                    task=self.task.name,
                )
            else:
                metrics.event(
                    "adoption_lost",
                    f"no record for {ref} after another delivery adopted it: not run",
                    level=logging.WARNING,
                    job_id=ref.id,
                    task=self.task.name,
                )
            raise Ignore()
        if job.task != self.task.name:
            metrics.event(
                "gate_conflict",
                f"message for {ref} as {self.task.name}, but the record is {job.task}: not run",
                level=logging.ERROR,
                job_id=ref.id,
                task=self.task.name,
            )
            raise Ignore()
        where = str(job.state)
        if job.attempt != attempt and not job.terminal:
            where = "stale_attempt"
        first = not delivery_info.get("redelivered") and messages.HEADER_GATE_RUNS not in headers
        why = " (a first delivery: the job will not run through this message)" if first else ""
        metrics.event(
            "suppressed_duplicate",
            f"duplicate delivery of {ref} (attempt {attempt}) skipped: the job is {job.state} "
            f"at attempt {job.attempt}{why}",
            level=logging.WARNING if first else logging.DEBUG,
            labels={"where": where},
            job_id=ref.id,
            task=self.task.name,
            first_delivery=first,
        )
        raise Ignore()

    def _refuse_newer(self, tickets: frozenset[str]) -> None:
        """A message of a newer format than this worker reads is not run here: sent back,
        delayed, for a worker of its version (one line naming both versions, at error)."""
        try:
            found = self.headers.get(messages.HEADER_FORMAT)
            formats.refuse_newer("message", found, f"the message of job {self.ref}")
        except exceptions.FormatTooNew as exc:
            metrics.event(
                "format_too_new",
                str(exc),
                level=logging.ERROR,
                sentry=True,
                job_id=self.ref.id,
                task=self.task.name,
            )
            delay = self.runtime.config.retry_delay_store
            raise (self._send_back(tickets, delay, exc) or self._give_back(exc)) from exc

    def _send_back(
        self, tickets: frozenset[str], delay: float, exc: BaseException
    ) -> BaseException | None:
        """Re-publish this delivery (same attempt) with its tickets; what the worker must raise.

        Celery's ``retry`` is not used: it counts against ``max_retries`` (a task on
        its last attempt would get ``MaxRetriesExceededError``, the delivery lost)
        and starts the next attempt. ``Retry`` once sent; ``None``: refused (counted).
        """
        attempt = self.attempt
        request = self.task.request
        headers = {**dict(request.headers or {}), **messages.headers_of(request)}
        headers[messages.HEADER_GATE_RUNS] = sorted(tickets)
        signature = self.task.signature_from_request(
            request, countdown=delay, retries=attempt, headers=headers
        )
        raw = raw_republish.set(attempt)
        try:
            signature.apply_async(add_to_parent=False)
        except Exception as error:  # the broker refused too: the caller keeps trying
            metrics.event(
                "gate_send_back_failed",
                f"gate of {request.id} could not send the delivery back ({error}): "
                "trying the store and the broker again",
                level=logging.WARNING,
                job_id=request.id,
                task=self.task.name,
            )
            return None
        finally:
            raw_republish.reset(raw)
        sent_back: BaseException = Retry(exc=exc, when=delay, sig=signature)
        return sent_back

    def _give_back(self, exc: BaseException) -> BaseException:
        """No store nor broker in time: ``Reject(requeue=True)`` (no tickets: at ERROR)."""
        lost = "" if self.task.acks_late else " (none: acked on receipt; left to the reconciler)"
        metrics.event(
            "gate_gave_up",
            f"gate of {self.ref} reached neither the store nor the broker: the message "
            f"goes back without its tickets{lost}",
            level=logging.ERROR,
            sentry=True,
            job_id=self.ref.id,
            task=self.task.name,
        )
        requeue: BaseException = Reject(exc, requeue=True)
        return requeue

    def finish(self, state: State, reason: str, *, carry: bool = False) -> None:
        """Write the run's outcome (``RUNNING →`` ``state``) on its run id, or (``carry``: a
        body's return, in a worker) carry it to this thread's next gate write
        (:mod:`~celery_exactonce.task.outcomes`). Any other outcome is in the record before
        Celery stores the result: a reader who saw a failure's result reads its record's end."""
        request = Transition(
            state,
            frozenset({State.RUNNING}),
            node=self.runtime.node,
            reason=reason,
            run_id=self.run_id,
        )
        key = self.headers.get(messages.HEADER_KEY)
        outcome = outcomes.Outcome(self.runtime, self.ref, request, self.task.name, key)
        outcomes.finish(outcome, carry=carry and not self.task.request.is_eager)


def validate_gated_task(task: Task) -> None:
    """Refuse settings that would let a gated body run twice (start-up validation).

    Per-task timeouts must pass the same consistency checks as the settings
    (``dispatch_timeout > replay_age``, ``dispatch_deadline >= dispatch_timeout``,
    ``running_timeout >= 3 x heartbeat_interval + max_skew``).
    """
    if getattr(task, "_exactonce_validated", False):
        return
    if task.reject_on_worker_lost and getattr(task, "exactonce_atomic", False):
        raise exceptions.ConfigurationError(
            f"{task.name}: reject_on_worker_lost is refused with exactonce_atomic: a lost "
            "worker's transaction rolled back, and the reconciler runs the job again",
            setting="reject_on_worker_lost",
        )
    if task.reject_on_worker_lost and not task.exactonce_rerun:
        raise exceptions.ConfigurationError(
            f"{task.name}: reject_on_worker_lost re-queues a message whose body may have run; "
            "it is refused on an ExactOnceTask unless exactonce_rerun=True",
            setting="reject_on_worker_lost",
        )
    check_timeouts(
        config_for(task.app), task_timeouts(task), prefix=f"{task.name}: task attribute "
    )
    unique.spec_of(task)
    task._exactonce_validated = True


def record_revoke(task: Any, request: Any, *, terminated: bool, expired: bool) -> None:
    """Revoke and ``expires`` end the job ``CANCELLED`` (no redispatch loop).

    Only for the attempt the revoked message carries: an expired copy of an
    earlier attempt says nothing of the attempt the job is at now. A job
    already ``RUNNING`` is cancelled only by a revoke with ``terminate=True``.
    """
    runtime = runtime_for(task.app)
    headers = {
        **messages.headers_of(getattr(request, "request_dict", None) or {}),
        **messages.headers_of(request),
    }
    ref = messages.ref_from_headers(headers, request.id)
    attempt = int(headers.get(messages.HEADER_ATTEMPT, getattr(request, "retries", 0) or 0))
    try:
        job = runtime.store.get(ref)
        if job is None or job.terminal or job.task != task.name or job.attempt != attempt:
            return
        if job.state is State.RUNNING:
            if not terminated:
                return
            guard: dict[str, Any] = {"run_id": job.run_id}
        else:
            guard = {"rev": job.rev}
        runtime.store.transition(
            ref,
            Transition(
                State.CANCELLED,
                frozenset({job.state}),
                node=runtime.node,
                reason="expired" if expired else "revoked",
                attempt=attempt,
                task=task.name,
                **guard,
            ),
        )
    except exceptions.StoreError as exc:
        metrics.event(
            "revoke_write_failed",
            f"could not record the revoke of {ref}: {exc}",
            level=logging.WARNING,
            job_id=ref.id,
            task=task.name,
        )
