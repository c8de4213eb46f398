"""ExactOnceTask: the worker gate around the body, and submission through the store.

Subclass it (``@app.task(base=ExactOnceTask)``) for the tasks whose body must
run at most once per attempt whatever the broker redelivers
(docs/design/protocol.md, "The worker gate"):

* **Submission.** ``apply_async``/``delay`` create the job in the store
  (create-if-absent on the ``task_id``) and publish it through the dispatch
  path. Once a record may exist, the only error it raises is
  :class:`~celery_exactonce.exceptions.SubmitAmbiguous` (resubmit the same id).
* **The gate.** Before the body: CAS ``SCHEDULED/DISPATCHED → RUNNING`` on the
  message's attempt, with a fresh ``run_id``. Any other state (a duplicate)
  raises Celery's ``Ignore``: the message is acked, no result is stored and no
  callback fires. A store error never lets the body run: the gate retries for
  a bounded time, then sends the delivery back through Celery's retry
  mechanism, carrying the run ids it tried so that a gate write that did
  apply is recognised as its own.
* **After the body.** ``RUNNING → SUCCEEDED`` or ``FAILED`` on the ``run_id``.
  A Celery retry (``self.retry``, ``autoretry_for``) is the next attempt of the
  same job, written before the retry is published.
* **Delayed jobs.** An ``eta`` or ``countdown`` in the future (on submit or on
  a retry) is never handed to the broker as an ETA message, which a Redis or
  SQS broker would deliver again after its visibility timeout: the job waits
  ``PENDING`` in the store with its ``run_at``, and a beat node
  (``ExactOnceScheduler``) dispatches it when it falls due. Delayed jobs need
  at least one ``celery beat -S exactonce`` running.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any, NoReturn

from celery import Task, signals
from celery.exceptions import Ignore, Reject, Retry

from celery_exactonce import exceptions, jobs, messages, metrics, payload, refs
from celery_exactonce.dispatch import Enqueued
from celery_exactonce.jobs import CreateStatus, Job
from celery_exactonce.policy import check_timeouts, task_policy, task_timeouts
from celery_exactonce.refs import JobRef
from celery_exactonce.requests import NewJob, Transition
from celery_exactonce.runtime import Runtime, config_for, runtime_for
from celery_exactonce.states import State
from celery_exactonce.stores import settle

#: Options of ``apply_async`` that belong to this call and are not stored:
#: process-local objects, kombu's publish retry (always off for us), and the
#: times that become the job's ``eta`` and ``deadline``. Everything else (queue,
#: priority, headers, link, chain, chord, root and parent ids...) is stored as
#: JSON with the job and published with every dispatch of it.
_LOCAL_OPTIONS = frozenset(
    {"producer", "connection", "router", "publisher", "retry", "retry_policy", "countdown",
     "eta", "expires", "task_id", "retries", *messages.CALL_OPTIONS}
)  # fmt: skip


@dataclasses.dataclass
class _Run:
    """The gated run in progress in this thread (what ``self.retry`` and ``replace`` need)."""

    ref: JobRef
    run_id: str
    attempt: int
    headers: Mapping[str, Any]
    #: The job that replaced this run (``Task.replace``), once submitted.
    replaced_by: JobRef | None = None


_current: contextvars.ContextVar[_Run | None] = contextvars.ContextVar(
    "exactonce_run", default=None
)
#: Set (to the attempt) while the gate sends a delivery back unchanged.
_raw_republish: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "exactonce_raw", default=None
)


class ExactOnceTask(Task):  # type: ignore[misc]  # celery is untyped
    """A Celery task whose body runs at most once per attempt (see the module docs)."""

    #: How long the gate keeps retrying a store error before sending the
    #: delivery back through Celery's retry mechanism.
    exactonce_gate_timeout: float = 30.0
    #: Opt in to redispatch of a stale ``DISPATCHED`` job by the reconciler
    #: (asserts that every consumer of the queue runs the gate).
    exactonce_redispatch: bool = False
    #: Opt in to re-running a ``RUNNING`` job whose worker vanished (at-least-once).
    exactonce_rerun: bool = False

    # -- submission ----------------------------------------------------------------

    def apply_async(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        """Create the job in the store, then dispatch it; returns its ``AsyncResult``.

        Raises
        ------
        InvalidPayload
            The arguments or options cannot be stored as JSON (nothing was stored).
        SubmitAmbiguous
            The store failed in a way that leaves the create's outcome unknown:
            submit the same ``task_id`` again.
        JobConflict
            ``task_id`` exists with a different task or payload.
        """
        raw_attempt = _raw_republish.get()
        if self.app.conf.task_always_eager or raw_attempt is not None:
            if raw_attempt is not None:
                options["retries"] = raw_attempt  # the same attempt, delivered again
            return super().apply_async(
                args, kwargs, task_id=task_id, producer=producer, link=link,
                link_error=link_error, shadow=shadow, **options,
            )  # fmt: skip
        run = _current.get()
        if (
            run is not None
            and task_id is not None
            and task_id == self.request.id
            and run.replaced_by is None
        ):  # the running task's own id: Celery's retry (or a Reject requeue) re-publishing it
            return self._retry_next_attempt(run, args, kwargs, options)
        return self._submit(args, kwargs, task_id, link, link_error, shadow, options)

    def _submit(
        self,
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
        task_id: str | None,
        link: Any,
        link_error: Any,
        shadow: str | None,
        options: dict[str, Any],
    ) -> Any:
        args, kwargs, shadow, options = self._before_send(args, kwargs, shadow, options)
        runtime = runtime_for(self.app)
        task_id = task_id or str(uuid.uuid4())
        call = {
            "result_cls": options.get("result_cls") or self.AsyncResult,
            "add_to_parent": options.get("add_to_parent", True),
        }
        stored = _storable_options(options)
        messages.check_options(stored, context=f"{self.name}.apply_async")
        for name, value in (("link", link), ("link_error", link_error)):
            if value is not None:
                stored[name] = [dict(s) for s in (value if isinstance(value, list) else [value])]
        if shadow is not None:
            stored["shadow"] = shadow
        # Results sent by the reply_to backend (rpc://) go to the caller, not to the
        # process that publishes the job when it falls due.
        stored.setdefault("reply_to", self.app.thread_oid)
        ref = JobRef.task(task_id)
        nesting = int(options.get("replaced_task_nesting") or 0)
        if nesting:  # a replacement (Task.replace) takes the id of the job it replaces
            ref = JobRef.task(messages.replacement_job_id(task_id, nesting))
            stored[messages.MESSAGE_ID_OPTION] = task_id
        eta = _eta(options)
        delayed = eta is not None and eta > datetime.now(timezone.utc)
        stored[messages.GATED_OPTION] = True
        stored[messages.POLICY_OPTION] = task_policy(self)
        new = NewJob(
            ref, self.name, State.PENDING if delayed else State.SCHEDULED,
            node=runtime.node, args=list(args or ()), kwargs=dict(kwargs or {}), options=stored,
            run_at=eta if delayed else None, deadline=_deadline(options.get("expires")),
            reason="apply_async (delayed)" if delayed else "apply_async",
        )  # fmt: skip
        enqueued = None if delayed else self._enqueue(runtime, new, call)
        if enqueued is not None and enqueued.created:
            return enqueued.sent  # one store call wrote the record and pushed the message
        if enqueued is not None:  # the job existed: nothing was pushed
            job = enqueued.job
            self._resubmitted(job, new)
            call = {**call, "add_to_parent": False}  # building the message added it already
        else:
            job = self._create(runtime, new)
        sent = None
        if job.state is State.SCHEDULED:
            # Ours, or a resubmission of a job whose first submit was ambiguous or
            # whose publish was rolled back: the CAS on its rev lets one dispatch win.
            sent = runtime.dispatcher.dispatch(job, reason="apply_async", call=call).sent
        if sent is not None:
            return sent  # send_task's own result: subscribed, ``ignored`` and parent set
        if enqueued is not None:
            return enqueued.sent
        return self._result(task_id, call, ignore_result=bool(options.get("ignore_result")))

    def _before_send(
        self,
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
        shadow: str | None,
        options: Mapping[str, Any],
    ) -> tuple[Sequence[Any] | None, Mapping[str, Any] | None, str | None, dict[str, Any]]:
        """What Celery's ``Task.apply_async`` does before it sends, before anything is stored.

        The time limits' ``ValueError``; the argument check (``TypeError``) when
        ``typing`` is on; the shadow name; the task's own execution options
        (``queue``, ``expires``, ``time_limit``...) under the call's;
        ``pydantic=True`` arguments dumped; ``ignore_result`` defaulted.
        """
        if self.soft_time_limit and self.time_limit and self.soft_time_limit > self.time_limit:
            raise ValueError("soft_time_limit must be less than or equal to time_limit")
        if self.typing:
            check = getattr(self, "__header__", None)
            if check is not None:
                check(*(args or ()), **(kwargs or {}))
        shadow = shadow or self.shadow_name(args, kwargs, options)
        merged = {**self._get_exec_options(), **options}
        dump = getattr(self, "_dump_pydantic_arguments", None)
        if dump is not None and merged.get("serializer") != "pickle":
            args, kwargs = dump(args, kwargs)
        merged.setdefault("ignore_result", self.ignore_result)
        return args, kwargs, shadow, merged

    def _result(self, task_id: str, call: Mapping[str, Any], *, ignore_result: bool) -> Any:
        """The ``AsyncResult`` ``send_task`` would have returned, for a job not published now."""
        result = call["result_cls"](task_id)
        result.ignored = ignore_result
        if not ignore_result:
            with self.app.producer_or_acquire(None) as producer:
                self.app.backend.on_task_call(producer, task_id)
        parent = self.app.current_worker_task if call["add_to_parent"] else None
        if parent is not None:
            parent.add_trail(result)
        return result

    @staticmethod
    def _enqueue(runtime: Runtime, new: NewJob, call: Mapping[str, Any]) -> Enqueued | None:
        """The one-call submit where the broker shares the store's Redis, or ``None``."""
        try:
            return runtime.dispatcher.enqueue(new, reason="apply_async", call=call)
        except exceptions.StoreError as exc:
            raise exceptions.SubmitAmbiguous(new.ref.id) from exc

    def _create(self, runtime: Runtime, new: NewJob) -> Job:
        """Create ``new`` (one read back if the answer is lost: the caller resubmits).

        Brief: a created record is not sent back, it is ``new`` as created, on
        this process's clock (as a brief ``DISPATCHED`` write computes its
        record), but where a signing key is set (the store signs the record).
        A job that exists is read.
        """
        brief = runtime.dispatcher.signer is None
        result = settle.create(runtime.store, new, brief=brief, tries=1)
        if result.applied and result.job is None:
            return jobs.job_from_new(new, datetime.now(timezone.utc))
        job, decision = result.job, result.decision
        if job is None and result.error is None and result.status is CreateStatus.EXISTS:
            back = settle.read_back(runtime.store, new.ref, new.rev, tries=1)
            job, decision = back.job, back.decision
        if job is None:
            raise exceptions.SubmitAmbiguous(new.ref.id) from result.error
        if decision is not settle.Decision.APPLIED:
            self._resubmitted(job, new)
        return job

    def _resubmitted(self, job: Job, new: NewJob) -> None:
        """A ``task_id`` submitted again: the same job (logged, counted), or a conflict.

        The same task and payload is the same job: it is not run again (a frozen
        signature applied twice runs once). Another task or payload, or the
        same one in another group, chord or chain (a frozen signature reused in a
        second canvas, which would wait forever for a part that never runs
        again), is refused with :class:`~celery_exactonce.exceptions.JobConflict`.
        """
        if (job.task, job.args, job.kwargs) != (new.task, new.args, new.kwargs):
            raise exceptions.JobConflict(
                f"task_id {new.ref.id!r} already exists as {job.task} with another payload"
            )
        differ = [name for name in _CANVAS_OPTIONS if _canvas(new.options, name) != _canvas(
            job.options, name)]  # fmt: skip
        if differ:
            raise exceptions.JobConflict(
                f"task_id {new.ref.id!r} already exists as a part of another canvas (its "
                f"{differ[0]} differs): a frozen signature runs in one canvas only; build the "
                "signature again for each canvas"
            )
        metrics.event(
            "resubmitted", f"{job.task} {new.ref.id} submitted again: the existing job "
            f"({job.state}) stands, not run again",
            job_id=new.ref.id, task=job.task, state=str(job.state),
        )  # fmt: skip

    def _retry_next_attempt(
        self,
        run: _Run,
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
        options: dict[str, Any],
        *,
        reason: str = "retry",
    ) -> Any:
        """Celery's retry re-publishes the task: make it the next attempt of the job first."""
        runtime = runtime_for(self.app)
        eta = _eta(options)
        delayed = eta is not None and eta > datetime.now(timezone.utc)
        reason = f"{reason} (delayed)" if delayed else reason
        request = Transition(
            State.PENDING if delayed else State.DISPATCHED, frozenset({State.RUNNING}),
            node=runtime.node, reason=reason,
            run_id=run.run_id, next_attempt=True, run_at=eta if delayed else None,
            args=list(args) if args is not None else None,
            kwargs=dict(kwargs) if kwargs is not None else None,
        )  # fmt: skip
        result = settle.transition(runtime.store, run.ref, request)
        exc = result.error
        if exc is not None and not result.applied:
            metrics.event(
                "fail_closed", f"retry of {run.ref} not written: nothing published",
                level=logging.WARNING, labels={"phase": "dispatched_write"}, sentry=True,
                job_id=run.ref.id, task=self.name, exc_info=exc,
            )  # fmt: skip
            raise Reject(exc, requeue=False) from exc
        job = result.job if result.applied else None
        if job is None:
            metrics.event(
                "retry_refused",
                f"{reason} of {run.ref} refused: the job moved on",
                job_id=run.ref.id,
            )
            return self.AsyncResult(self.request.id)
        if job.state is State.DISPATCHED:  # a delayed retry waits PENDING for the sweep
            runtime.dispatcher.publish(job, extra={"eta": eta} if eta is not None else None)
        return self.AsyncResult(self.request.id)

    def on_replace(self, sig: Any) -> Any:
        """Submit the replacement through the store, then end this run (``Task.replace``).

        Celery gives the replacement this task's id, so the caller's result is
        the replacement's. Its job cannot have that id (this run's job holds it):
        it gets :func:`~celery_exactonce.messages.replacement_job_id` of it,
        deterministic, so submitting it again finds it. This job ends
        ``SUCCEEDED``, its reason naming the replacement.
        """
        run = _current.get()
        if run is None or self.request.is_eager:
            return super().on_replace(sig)
        nesting = int(self.request.get("replaced_task_nesting") or 0) + 1
        run.replaced_by = JobRef.task(messages.replacement_job_id(self.request.id, nesting))
        return super().on_replace(sig)  # submits it, then raises Ignore

    def _requeue(self, run: _Run, exc: Reject) -> NoReturn:
        """``Reject(requeue=True)``: the next attempt of the job, published; this message acked.

        Giving the message itself back would only meet the gate again (its
        attempt has run). The job moves to its next attempt first, as a retry
        does, then a copy is published for it, at the back of the queue. Only
        with ``acks_late``, as in Celery: a message acked on receipt cannot go back.
        """
        metrics.event(
            "requeued",
            f"{self.name} rejected {run.ref} with requeue: running it again as attempt "
            f"{run.attempt + 1}",
            job_id=run.ref.id,
        )
        self._retry_next_attempt(run, None, None, {}, reason=f"requeued: {exc.reason}")
        raise Ignore()

    # -- the gate --------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly or request.is_eager:
            return self.run(*args, **kwargs)
        validate_gated_task(self)
        runtime = runtime_for(self.app, setup=False)
        headers = messages.headers_of(request)
        ref = messages.ref_from_headers(headers, request.id)
        attempt = int(headers.get(messages.HEADER_ATTEMPT, request.retries or 0))
        run_id = refs.new_token()
        key = headers.get(messages.HEADER_IDEMPOTENCY_KEY)
        # The record is wanted only for the idempotency key of a message without one:
        # otherwise the gate's CAS is brief (no record sent back and decoded).
        job = self._gate(
            runtime, ref, attempt, run_id, headers, args, kwargs, request.delivery_info or {},
            brief=bool(key),
        )  # fmt: skip
        if not key and job is not None:
            key = messages.job_idempotency_key(job, runtime.store.namespace)
        request.idempotency_key = key
        run = _Run(ref, run_id, attempt, headers)
        token = _current.set(run)
        beat = _heartbeats.start(runtime, ref, run_id)
        try:
            result = self.run(*args, **kwargs)
        except Retry:
            raise  # the retry already made this the next attempt of the job
        except Ignore:
            if run.replaced_by is not None:
                replaced = f"replaced by {run.replaced_by}"
                self._finish(runtime, ref, run_id, State.SUCCEEDED, replaced)
            else:
                self._finish(runtime, ref, run_id, State.CANCELLED, "the body raised Ignore")
            raise
        except Reject as exc:
            if exc.requeue and self.acks_late:  # acked at once, a message cannot go back
                self._requeue(run, exc)
            self._finish(runtime, ref, run_id, State.FAILED, f"rejected: {exc.reason}")
            raise
        except BaseException as exc:
            self._finish(runtime, ref, run_id, State.FAILED, f"{type(exc).__name__}: {exc}")
            raise
        else:
            self._finish(runtime, ref, run_id, State.SUCCEEDED, "body returned")
            return result
        finally:
            _heartbeats.stop(beat)
            _current.reset(token)

    def _gate(
        self,
        runtime: Runtime,
        ref: JobRef,
        attempt: int,
        run_id: str,
        headers: Mapping[str, Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        delivery_info: Mapping[str, Any],
        *,
        brief: bool = False,
    ) -> Job | None:
        """Pass the gate (returning the ``RUNNING`` job this delivery owns) or raise.

        ``run_id`` is this delivery's own token, fresh for it: the body runs
        only once the store confirms the job ``RUNNING`` under it. Raises
        ``Ignore`` for a delivery the job does not wait for, and the exception
        of :meth:`_send_back` when the store stays unreachable. With ``brief``
        the CAS may answer without the record: ``None`` when it applied (a
        refused CAS carries the record all the same, to decide on).

        A write whose answer is lost is settled by reading the record back
        (never by guessing). A delivery that could not settle in time is sent
        back carrying *tickets*: the run ids it (or the deliveries before it)
        may have written. A ticket is not ownership: the next delivery holding
        it must *take over* the run with a CAS from that run id to its own,
        which only one copy of a message can win.
        """
        tickets = frozenset(str(t) for t in headers.get(messages.HEADER_GATE_RUNS) or ())
        gate = Transition(
            State.RUNNING, frozenset({State.SCHEDULED, State.DISPATCHED}), node=runtime.node,
            reason="gate", attempt=attempt, task=self.name, new_run_id=run_id,
        )  # fmt: skip
        deadline = time.monotonic() + self.exactonce_gate_timeout
        delay = runtime.config.retry_delay_store
        adoption_lost = False
        write: Transition | None = gate  # the next write; None: read the record first
        while True:
            try:
                if write is None:
                    job = runtime.store.get(ref)
                else:  # brief goes through transition_many: the store contract's brief CAS
                    (result,) = runtime.store.transition_many([(ref, write)], brief=brief)
                    if result.applied and (brief or result.job is not None):
                        return result.job
                    job = result.job
                if job is None:
                    if adoption_lost or messages.HEADER_JOB_ID in headers:
                        self._refuse(ref, None, attempt, headers, delivery_info)
                    adopted = self._adopt(runtime, ref, run_id, args, kwargs)
                    if adopted is not None:
                        return adopted
                    adoption_lost, write = True, gate  # another delivery adopted it first
                    continue
                if job.state is State.RUNNING and job.run_id == run_id:
                    return job  # our own write applied; its answer was lost
                write = self._next_write(runtime, job, attempt, run_id, tickets, gate)
                if write is None:
                    self._refuse(ref, job, attempt, headers, delivery_info)
            except exceptions.StoreError as exc:
                write = None  # what did the store keep? read it back before writing again
                if time.monotonic() + delay > deadline:
                    metrics.event(
                        "fail_closed", f"gate of {ref} cannot reach the store: delivery sent back",
                        level=logging.WARNING, labels={"phase": "gate_read"}, sentry=True,
                        job_id=ref.id, task=self.name, exc_info=exc,
                    )  # fmt: skip
                    raise self._send_back(tickets | {run_id}, attempt, delay, exc) from exc
                time.sleep(delay)
                delay = min(delay * 2, 10.0)

    def _next_write(
        self,
        runtime: Runtime,
        job: Job,
        attempt: int,
        run_id: str,
        tickets: frozenset[str],
        gate: Transition,
    ) -> Transition | None:
        """The write that would let this delivery run ``job`` as read, or ``None``: not ours."""
        if job.task != self.name or job.attempt != attempt:
            return None
        if job.state in gate.expect:
            return gate  # our earlier write did not apply: try it again
        if job.state is State.RUNNING and job.run_id in tickets:
            return Transition(
                State.RUNNING, frozenset({State.RUNNING}), node=runtime.node,
                reason="gate: taken over from a delivery sent back", attempt=attempt,
                task=self.name, run_id=job.run_id, new_run_id=run_id,
            )  # fmt: skip
        return None

    def _adopt(
        self,
        runtime: Runtime,
        ref: JobRef,
        run_id: str,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
    ) -> Job | None:
        """A message from elsewhere (no headers, no record): create its job as ``RUNNING``.

        ``None`` if another delivery's create won. A store error propagates:
        the gate reads back whether this create applied.
        """
        new = NewJob(
            ref, self.name, State.RUNNING, node=runtime.node, args=list(args),
            kwargs=dict(kwargs), run_id=run_id,
            options={messages.GATED_OPTION: True, messages.POLICY_OPTION: task_policy(self)},
            reason="adopted at the gate",
        )  # fmt: skip
        result = runtime.store.create(new)
        if result.created or (result.job is not None and result.job.rev == new.rev):
            metrics.event("adopted", f"adopted {ref} at the gate", level=logging.DEBUG,
                          job_id=ref.id, task=self.name)  # fmt: skip
            return result.job
        return None

    def _refuse(
        self,
        ref: JobRef,
        job: Job | None,
        attempt: int,
        headers: Mapping[str, Any],
        delivery_info: Mapping[str, Any],
    ) -> NoReturn:
        """Ack the delivery unrun (``Ignore``: no result, no callback), counted and logged.

        A redelivery refused is the gate doing its work (debug). A first
        delivery refused means a job that will not run through this message,
        which an operator should see (warning).
        """
        if job is None:
            if messages.HEADER_JOB_ID in headers:
                metrics.event(
                    "record_lost", f"no record for {ref}, whose message carries our "
                    "headers: not run (the store lost it)",
                    level=logging.ERROR, job_id=ref.id, task=self.name,
                )  # fmt: skip
            else:
                metrics.event(
                    "adoption_lost", f"no record for {ref} after another delivery adopted it: "
                    "not run", level=logging.WARNING, job_id=ref.id, task=self.name,
                )  # fmt: skip
            raise Ignore()
        if job.task != self.name:
            metrics.event(
                "gate_conflict", f"message for {ref} as {self.name}, but the record is "
                f"{job.task}: not run",
                level=logging.ERROR, job_id=ref.id, task=self.name,
            )  # fmt: skip
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
            level=logging.WARNING if first else logging.DEBUG, labels={"where": where},
            job_id=ref.id, task=self.name, first_delivery=first,
        )  # fmt: skip
        raise Ignore()

    def _send_back(
        self, tickets: frozenset[str], attempt: int, delay: float, exc: BaseException
    ) -> BaseException:
        """Re-publish this delivery (same attempt) with its tickets; what the worker must raise.

        Celery's ``retry`` is not used: it counts against ``max_retries`` (a task
        on its last attempt would get ``MaxRetriesExceededError`` and the
        delivery would be lost) and starts the next attempt. Returns ``Retry``
        once the copy is sent; if it cannot be sent, ``Reject(requeue=True)``,
        which gives the message back to the broker where ``acks_late`` holds it.
        """
        request = self.request
        headers = {**dict(request.headers or {}), **messages.headers_of(request)}
        headers[messages.HEADER_GATE_RUNS] = sorted(tickets)
        signature = self.signature_from_request(
            request, countdown=delay, retries=attempt, headers=headers
        )
        raw = _raw_republish.set(attempt)
        try:
            signature.apply_async(add_to_parent=False)
        except Exception as error:  # the broker refused too: hand the message back
            metrics.event(
                "gate_send_back_failed",
                f"gate of {request.id} could not send the delivery back ({error}): requeued",
                level=logging.WARNING,
                job_id=request.id,
            )
            requeue: BaseException = Reject(exc, requeue=True)
            return requeue
        finally:
            _raw_republish.reset(raw)
        sent_back: BaseException = Retry(exc=exc, when=delay, sig=signature)
        return sent_back

    def _finish(
        self, runtime: Runtime, ref: JobRef, run_id: str, state: State, reason: str
    ) -> None:
        request = Transition(
            state, frozenset({State.RUNNING}), node=runtime.node,
            reason=reason, run_id=run_id,
        )  # fmt: skip
        delay = runtime.config.retry_delay_store
        error: BaseException | None = None
        for _ in range(3):
            # Brief: an applied completion needs no record back; a refused one carries it.
            result = settle.transition(runtime.store, ref, request, brief=True)
            if result.error is not None and not result.applied:
                error = result.error
                time.sleep(delay)
                continue
            if not result.applied:
                # The run no longer owns the job (the reconciler timed it out, a
                # revoke cancelled it): the outcome is late and changes nothing,
                # but the record says it (a note, never a change of state).
                current = result.job.state if result.job else "no record"
                metrics.event(
                    "late_outcome",
                    f"late outcome {state} of {ref} ignored: the job is {current}",
                    level=logging.WARNING,
                    job_id=ref.id,
                    state=str(state),
                )
                if result.job is not None:
                    self._note_late(runtime, ref, run_id, state, reason)
            return
        metrics.event(
            "completion_write_failed", f"could not record {state} for {ref}; "
            "the reconciler will settle it",
            level=logging.ERROR, labels={"state": str(state)}, sentry=True, job_id=ref.id,
            task=self.name, exc_info=error,
        )  # fmt: skip

    @staticmethod
    def _note_late(runtime: Runtime, ref: JobRef, run_id: str, state: State, reason: str) -> None:
        note = f"late outcome of run {run_id}: {state} ({reason}); not applied"
        with contextlib.suppress(exceptions.StoreError):  # the warning above stands
            runtime.store.annotate(ref, node=runtime.node, reason=note, op_id=refs.new_token())


@dataclasses.dataclass
class _Beating:
    """One run the heartbeat thread touches."""

    runtime: Runtime
    ref: JobRef
    run_id: str
    due: float  # monotonic


class _Heartbeats:
    """One thread per process touches every running job of it every ``heartbeat_interval``.

    A run registers when its body starts and leaves when it ends: a body shorter
    than the interval costs two dictionary operations and no store call (a
    thread per run cost a thread start and a join each). The thread starts with
    the first run of a process, again in a forked child (a prefork pool process).
    The thread is woken only for a run due before it would wake anyway (the
    first one after an idle spell), not at every start.
    """

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._runs: dict[int, _Beating] = {}
        self._tokens = itertools.count()
        self._pid: int | None = None
        #: When the waiting thread wakes by itself (monotonic); -inf while it is not waiting.
        self._wakes_at = -math.inf

    def start(self, runtime: Runtime, ref: JobRef, run_id: str) -> int:
        """Touch ``ref`` under ``run_id`` every interval from now on; the token to stop it."""
        due = time.monotonic() + runtime.config.heartbeat_interval
        with self._lock:
            if self._pid != os.getpid():  # first run here, or a forked child: no thread yet
                self._pid, self._runs, self._wakes_at = os.getpid(), {}, -math.inf
                threading.Thread(target=self._loop, name="exactonce-heartbeat", daemon=True).start()
            token = next(self._tokens)
            self._runs[token] = _Beating(runtime, ref, run_id, due)
            if due < self._wakes_at:
                self._lock.notify()
        return token

    def stop(self, token: int) -> None:
        with self._lock:
            self._runs.pop(token, None)

    def _loop(self) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                due = [(token, run) for token, run in self._runs.items() if run.due <= now]
                if not due:
                    nearest = min((run.due for run in self._runs.values()), default=now + 60.0)
                    self._wakes_at = nearest
                    self._lock.wait(timeout=nearest - now)
                    self._wakes_at = -math.inf  # not waiting: it looks at every run before it does
                    continue
                for _, run in due:
                    run.due = now + run.runtime.config.heartbeat_interval
            for token, run in due:
                if not self._beat(run):
                    self.stop(token)

    @staticmethod
    def _beat(run: _Beating) -> bool:
        """Touch one run; whether it is still ours (a store error keeps it)."""
        try:
            return run.runtime.store.heartbeat(run.ref, run.run_id)
        except exceptions.StoreError as exc:
            run.runtime.note_store_error()
            metrics.event(
                "heartbeat_failed",
                f"heartbeat of {run.ref} failed: {exc}",
                level=logging.WARNING,
                job_id=run.ref.id,
            )
            return True


_heartbeats = _Heartbeats()


def validate_gated_task(task: Task) -> None:
    """Refuse settings that would let a gated body run twice (start-up validation).

    Per-task timeouts must pass the same consistency checks as the settings
    (``dispatch_timeout > replay_age``, ``dispatch_deadline >= dispatch_timeout``,
    ``running_timeout >= 3 x heartbeat_interval + max_skew``).
    """
    if getattr(task, "_exactonce_validated", False):
        return
    if task.reject_on_worker_lost and not task.exactonce_rerun:
        raise exceptions.ConfigurationError(
            f"{task.name}: reject_on_worker_lost re-queues a message whose body may have run; "
            "it is refused on an ExactOnceTask unless exactonce_rerun=True",
            setting="reject_on_worker_lost",
        )
    check_timeouts(
        config_for(task.app), task_timeouts(task), prefix=f"{task.name}: task attribute "
    )
    task._exactonce_validated = True


#: Options that place a job in a canvas: the group or chord it is a part of, and
#: the rest of its chain.
_CANVAS_OPTIONS = ("group_id", "chord", "chain")


def _canvas(options: Mapping[str, Any], name: str) -> str:
    """Canvas option ``name`` of a job (stored or about to be), comparable across the two."""
    return payload.encode_payload({name: options.get(name)}, context="canvas options")


def _storable_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options of an ``apply_async`` call to store with the job (JSON-able)."""
    stored: dict[str, Any] = {}
    for name, value in options.items():
        if name in _LOCAL_OPTIONS or value is None:
            continue
        routed_by_name = name in ("queue", "exchange") and hasattr(value, "name")
        stored[name] = value.name if routed_by_name else value  # a kombu Queue/Exchange
    return stored


def _eta(options: Mapping[str, Any]) -> datetime | None:
    eta = options.get("eta")
    if isinstance(eta, str):
        eta = _iso(eta)
    if isinstance(eta, datetime):
        return eta if eta.tzinfo else eta.replace(tzinfo=timezone.utc)
    countdown = options.get("countdown")
    if countdown is not None:
        return datetime.now(timezone.utc) + timedelta(seconds=float(countdown))
    return None


def _iso(text: str) -> datetime:
    """An ISO 8601 time (a ``Z`` suffix too, which Python 3.10 does not read)."""
    return datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)


def _deadline(expires: Any) -> datetime | None:
    """The job's deadline from ``expires``: a time, or seconds from the call, as in Celery.

    Seconds count from the call, not from the eta: ``countdown=60, expires=30``
    expires before it is due, and is never run.
    """
    if expires is None:
        return None
    if isinstance(expires, str):  # ISO 8601, as Celery's apply_async takes it; or seconds
        try:
            expires = float(expires)
        except ValueError:
            expires = _iso(expires)
    if isinstance(expires, datetime):
        return expires if expires.tzinfo else expires.replace(tzinfo=timezone.utc)
    return datetime.now(timezone.utc) + timedelta(seconds=float(expires))


def _on_revoked(
    sender: Any = None, request: Any = None, terminated: bool = False, **_kw: Any
) -> None:
    """Revoke and ``expires`` end the job ``CANCELLED`` (no redispatch loop).

    Only for the attempt the revoked message carries: an expired copy of an
    earlier attempt says nothing of the attempt the job is at now.
    """
    if not isinstance(sender, ExactOnceTask) or request is None:
        return
    runtime = runtime_for(sender.app)
    headers = {
        **messages.headers_of(getattr(request, "request_dict", None) or {}),
        **messages.headers_of(request),
    }
    ref = messages.ref_from_headers(headers, request.id)
    attempt = int(headers.get(messages.HEADER_ATTEMPT, getattr(request, "retries", 0) or 0))
    try:
        job = runtime.store.get(ref)
        if job is None or job.terminal or job.task != sender.name or job.attempt != attempt:
            return
        if job.state is State.RUNNING:
            if not terminated:
                return
            guard: dict[str, Any] = {"run_id": job.run_id}
        else:
            guard = {"rev": job.rev}
        runtime.store.transition(
            ref,
            Transition(State.CANCELLED, frozenset({job.state}), node=runtime.node,
                       reason="revoked" if not _kw.get("expired") else "expired",
                       attempt=attempt, task=sender.name, **guard),
        )  # fmt: skip
    except exceptions.StoreError as exc:
        metrics.event(
            "revoke_write_failed",
            f"could not record the revoke of {ref}: {exc}",
            level=logging.WARNING,
            job_id=ref.id,
        )


signals.task_revoked.connect(_on_revoked, weak=False)
