"""ExactOnceTask: the worker gate around the body, and submission through the store.

Subclass it (``@app.task(base=ExactOnceTask)``) for the tasks whose body must
run at most once per attempt whatever the broker redelivers
(docs/design/protocol.md, "The worker gate"):

* **Submission.** ``apply_async``/``delay`` create the job in the store
  (create-if-absent on the ``task_id``) and publish it through the dispatch
  path. Once a record may exist, the only error it raises is
  :class:`~celery_exactonce.core.exceptions.SubmitAmbiguous` (resubmit the same id).
* **The gate.** Before the body: CAS ``SCHEDULED/DISPATCHED → RUNNING`` on the
  message's attempt, with a fresh ``run_id``. Any other state (a duplicate)
  raises Celery's ``Ignore``: the message is acked, no result is stored and no
  callback fires. A store error never lets the body run: the gate retries for
  a bounded time, then sends the delivery back through Celery's retry
  mechanism, carrying the run ids it tried so that a gate write that did
  apply is recognised as its own.
* **After the body.** ``RUNNING → SUCCEEDED`` or ``FAILED`` on the ``run_id``.
  A Celery retry (``self.retry``, ``autoretry_for``) is the next attempt of the
  same job, written before the retry is published; asked for inside the body's
  own transaction (``django://``), written once the body has ended, as is a
  replacement (:mod:`~celery_exactonce.task.later`).
* **Delayed jobs.** An ``eta`` or ``countdown`` in the future (on submit or on
  a retry) is never handed to the broker as an ETA message, which a Redis or
  SQS broker would deliver again after its visibility timeout: the job waits
  ``PENDING`` in the store with its ``run_at``, and a beat node
  (``ExactOnceScheduler``) dispatches it when it falls due. Delayed jobs need
  at least one ``celery beat -S exactonce`` running.

Not here: a delivery's writes at the gate and a revoke's
(:mod:`~celery_exactonce.task.gate`), the heartbeats
(:mod:`~celery_exactonce.task.heartbeats`), what a call's options become in the job
(:mod:`~celery_exactonce.task.call_options`), creating the job's record and judging
one already there (:mod:`~celery_exactonce.task.submit`), the dispatch
(:mod:`~celery_exactonce.dispatch.dispatcher`), eager mode, ``apply()`` and direct calls,
and the idempotency key they carry (:mod:`~celery_exactonce.task.eager`).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from celery import Task, signals
from celery.exceptions import Ignore, Reject, Retry

from celery_exactonce.core import refs
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import Transition
from celery_exactonce.dispatch import messages
from celery_exactonce.observe import metrics, traces
from celery_exactonce.runtime import Runtime, runtime_for
from celery_exactonce.stores import settle
from celery_exactonce.task import atomic, call_options, eager, ends, later, requeues, submit
from celery_exactonce.task.gate import Delivery, raw_republish, record_revoke, validate_gated_task
from celery_exactonce.task.heartbeats import heartbeats


@dataclasses.dataclass
class _Run:
    """The gated run in progress in this thread (what ``self.retry`` and ``replace`` need)."""

    ref: JobRef
    run_id: str
    attempt: int
    headers: Mapping[str, Any]
    #: The job that replaced this run (``Task.replace``), once submitted.
    replaced_by: JobRef | None = None
    #: Writes about this job's future (its retry, its replacement) asked for inside a
    #: transaction the body holds open on the store's connection (``django://``): made
    #: once the body has ended, so that its rollback cannot undo them (:mod:`~.later`).
    later: list[Callable[[], object]] = dataclasses.field(default_factory=list)


_current: contextvars.ContextVar[_Run | None] = contextvars.ContextVar(
    "exactonce_run", default=None
)


class ExactOnceTask(Task):  # type: ignore[misc]  # celery is untyped
    """A Celery task whose body runs at most once per attempt.

    ``apply_async`` and ``delay`` create the job in the store before publishing
    it; on the worker, the gate lets one delivery of each attempt run the body
    and acks any other unrun. An ``eta`` or ``countdown`` waits in the store,
    and a beat node dispatches the job when it falls due.
    docs/howto/worker-gate.md tells the whole story.
    """

    #: How long the gate keeps retrying a store error before sending the
    #: delivery back through Celery's retry mechanism.
    exactonce_gate_timeout: float = 30.0
    #: The reconciler's timeouts for this task's jobs, in seconds, over the settings of
    #: the same names (``exactonce_dispatch_timeout``...); ``None``: the setting's.
    exactonce_dispatch_timeout: float | None = None
    exactonce_dispatch_deadline: float | None = None
    exactonce_running_timeout: float | None = None
    #: Opt in to redispatch of a stale ``DISPATCHED`` job by the reconciler
    #: (asserts that every consumer of the queue runs the gate).
    exactonce_redispatch: bool = False
    #: Opt in to re-running a ``RUNNING`` job whose worker vanished (at-least-once).
    exactonce_rerun: bool = False
    #: Run the gate, the body and its end in one transaction of the store's database,
    #: which the body writes to (``django://``): :mod:`~celery_exactonce.task.atomic`.
    exactonce_atomic: bool = False
    #: What makes two calls one job while it is live: argument names, or a function of the
    #: call's arguments returning the key (:mod:`~celery_exactonce.task.unique`).
    exactonce_unique: Any = None

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
        raw_attempt = raw_republish.get()
        if raw_attempt is None and self.app.conf.task_always_eager:
            return self._apply_eagerly(args, kwargs, task_id, link, link_error, shadow, options)
        if raw_attempt is not None:
            options["retries"] = raw_attempt  # the same attempt, delivered again
            return super().apply_async(
                args,
                kwargs,
                task_id=task_id,
                producer=producer,
                link=link,
                link_error=link_error,
                shadow=shadow,
                **options,
            )
        run = _current.get()
        if (
            run is not None
            and task_id is not None
            and task_id == self.request.id
            and run.replaced_by is None
        ):  # the running task's own id: Celery's retry re-publishing it
            if not later.made_now(runtime_for(self.app)):  # inside the body's transaction
                retry = functools.partial(self._retry_next_attempt, run, args, kwargs, options)
                run.later.append(later.as_celery_retry(retry))
                return self.AsyncResult(self.request.id)
            return self._retry_next_attempt(run, args, kwargs, options)
        task_id = task_id or str(uuid.uuid4())
        with traces.span("exactonce.submit", job_id=task_id, task=self.name):
            return self._submit(args, kwargs, task_id, link, link_error, shadow, options)

    def _apply_eagerly(
        self,
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
        task_id: str | None,
        link: Any,
        link_error: Any,
        shadow: str | None,
        options: dict[str, Any],
    ) -> Any:
        """Eager mode: the body runs now, in this process (:mod:`~celery_exactonce.task.eager`)."""
        task_id = task_id or str(uuid.uuid4())
        call = {"link": link, "link_error": link_error, "shadow": shadow}
        ignored = eager.submit_eagerly(self, task_id, args, kwargs, call, options)
        if ignored is not None:
            return ignored  # the job was there: the same job, not run again
        return super().apply_async(args, kwargs, task_id=task_id, **call, **options)

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
        args, kwargs, shadow, options = submit.before_send(self, args, kwargs, shadow, options)
        runtime = runtime_for(self.app)
        task_id = task_id or str(uuid.uuid4())
        call = {
            "result_cls": options.get("result_cls") or self.AsyncResult,
            "add_to_parent": options.get("add_to_parent", True),
        }
        new = submit.new_job(
            self,
            runtime.node,
            task_id,
            args,
            kwargs,
            link=link,
            link_error=link_error,
            shadow=shadow,
            options=options,
        )
        delayed = new.state is State.PENDING
        enqueued = None if delayed or new.unique else submit.enqueue(runtime, new, call)
        if enqueued is not None and enqueued.created:
            # One store write made the record DISPATCHED (with its message on a shared
            # Redis), then published it: send_task's result, or none if that failed.
            if enqueued.sent is not None:
                return enqueued.sent
            return submit.result_of(self, task_id, call, options)
        if enqueued is not None:  # the job existed: nothing was pushed
            job = enqueued.job
            submit.resubmitted(job, new)
            if enqueued.sent is not None:  # building the message added it already
                call = {**call, "add_to_parent": False}
        else:
            job = submit.create(runtime, new)
            if job.ref != new.ref:  # a live job holds the unique key: it is this call's job
                return submit.result_of(self, messages.message_task_id(job), call, options)
            on_commit = submit.after_commit(runtime)
            if on_commit is not None and (job.state is State.SCHEDULED or submit.republishes(job)):
                # In the caller's transaction: published once it commits; a rollback
                # leaves no job and no message; a crash in between leaves the job
                # SCHEDULED for the reconciler.
                on_commit(lambda: self._dispatch_after_commit(runtime, job, call))
                return submit.result_of(self, task_id, call, options)
        sent = None
        if job.state is State.SCHEDULED or submit.republishes(job):
            # Ours, or a resubmission of a job whose first submit was ambiguous or
            # whose publish was rolled back or may have failed: the CAS on its rev lets
            # one dispatch win; a copy that lands beside an earlier one, the gate drops.
            reason = "apply_async" if job.state is State.SCHEDULED else "apply_async (again)"
            dispatched = runtime.dispatcher.dispatch(job, reason=reason, call=call, republish=True)
            sent = dispatched.sent
        if sent is not None:
            return sent  # send_task's own result: subscribed, ``ignored`` and parent set
        if enqueued is not None and enqueued.sent is not None:
            return enqueued.sent  # the one-step submit built the message's result
        return submit.result_of(self, task_id, call, options)

    @staticmethod
    def _dispatch_after_commit(runtime: Runtime, job: Job, call: Mapping[str, Any]) -> None:
        runtime.dispatcher.dispatch(
            job, reason="apply_async (on commit)", call=call, republish=True
        )

    def _retry_next_attempt(
        self,
        run: _Run,
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
        options: dict[str, Any],
        *,
        reason: str = "retry",
        publish: bool = True,
        requeued: bool = False,
    ) -> Any:
        """Celery's retry re-publishes the task: make it the next attempt of the job first."""
        runtime = runtime_for(self.app)
        eta = call_options.eta_of(options)
        delayed = eta is not None and eta > datetime.now(timezone.utc)
        reason = f"{reason} (delayed)" if delayed else reason
        request = Transition(
            State.PENDING if delayed else State.DISPATCHED,
            frozenset({State.RUNNING}),
            node=runtime.node,
            reason=reason,
            run_id=run.run_id,
            next_attempt=True,
            run_at=eta if delayed else None,
            args=list(args) if args is not None else None,
            kwargs=dict(kwargs) if kwargs is not None else None,
        )
        result = settle.transition(runtime.store, run.ref, request)
        exc = result.error
        if exc is not None and not result.applied:
            metrics.event(
                "fail_closed",
                f"retry of {run.ref} not written: nothing published",
                level=logging.WARNING,
                labels={"phase": "dispatched_write"},
                sentry=True,
                job_id=run.ref.id,
                task=self.name,
                exc_info=exc,
            )
            raise Reject(exc, requeue=False) from exc
        job = result.job if result.applied else None
        if job is None:
            metrics.event(
                "retry_refused",
                f"{reason} of {run.ref} refused: the job moved on",
                job_id=run.ref.id,
                task=self.name,
            )
            return self.AsyncResult(self.request.id)
        if publish and job.state is State.DISPATCHED:  # a delayed retry waits PENDING
            extra: dict[str, Any] = {"eta": eta} if eta is not None else {}
            if requeued:
                headers = {**dict(job.options.get("headers") or {}), messages.HEADER_REQUEUED: 1}
                extra["headers"] = headers
            runtime.dispatcher.publish(job, extra=extra)
        return self.AsyncResult(self.request.id)

    def _retry_eagerly(self, run: _Run, exc: Retry) -> None:
        """An eager retry: the next attempt of the job, which Celery's ``apply`` then runs.

        Celery runs ``exc.sig`` in this process once this run ends, with our
        headers as this run had them: they must name the next attempt.
        """
        sig = exc.sig
        if sig is None:
            return
        self._retry_next_attempt(run, sig.args, sig.kwargs, {}, publish=False)
        headers = dict(sig.options.get("headers") or {})
        sig.options["headers"] = {**headers, messages.HEADER_ATTEMPT: run.attempt + 1}

    def on_replace(self, sig: Any) -> Any:
        """Submit the replacement through the store, then end this run (``Task.replace``).

        Celery gives the replacement this task's id, so the caller's result is
        the replacement's. Its job cannot have that id (this run's job holds it):
        it gets :func:`~celery_exactonce.dispatch.messages.replacement_job_id` of it,
        deterministic, so submitting it again finds it. This job ends
        ``SUCCEEDED``, its reason naming the replacement.
        """
        run = _current.get()
        if run is None or self.request.is_eager:
            return super().on_replace(sig)
        nesting = int(self.request.get("replaced_task_nesting") or 0) + 1
        run.replaced_by = JobRef.submitted(messages.replacement_job_id(self.request.id, nesting))
        if not later.made_now(runtime_for(self.app)):
            run.later.append(sig.delay)  # submitted once the body's transaction has ended
            raise Ignore("Replaced by new task")
        return super().on_replace(sig)  # submits it, then raises Ignore

    # -- the gate --------------------------------------------------------------------

    @property
    def request(self) -> Any:
        """Celery's request; outside any call (``task.run()``) one carrying the direct key."""
        top = self.request_stack.top
        return top if top is not None else eager.outside_request(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly:  # ``task(...)``: no job, no gate (celery_exactonce.task.eager)
            return eager.call_directly(self, args, kwargs)
        runtime = eager.in_process_runtime(self.app) if request.is_eager else None
        if request.is_eager and runtime is None:  # no store in this process: none is opened
            request.idempotency_key = eager.run_key(self.app, request.id)
            return self.run(*args, **kwargs)
        validate_gated_task(self)
        runtime = runtime or runtime_for(self.app, setup=False)
        headers = messages.headers_of(request)
        ref = messages.ref_from_headers(headers, request.id)
        attempt = int(headers.get(messages.HEADER_ATTEMPT, request.retries or 0))
        key = headers.get(messages.HEADER_IDEMPOTENCY_KEY)
        delivery = Delivery(
            self, runtime, ref, attempt, refs.new_token(), headers, request.delivery_info or {}
        )
        # The record is wanted only for the idempotency key of a message without one:
        # otherwise the gate's CAS is brief (no record sent back and decoded). An atomic
        # run (of one of our messages) passes it in the body's transaction.
        atomic_run = self.exactonce_atomic and bool(key) and not request.is_eager
        gate = traces.span("exactonce.gate", job_id=ref.id, task=self.name, attempt=attempt)
        with gate:
            job = None if atomic_run else delivery.enter(args, kwargs, brief=bool(key))
        run_id = delivery.run_id  # fresh for this delivery (another if it took its own run over)
        if not key and job is not None:
            key = messages.job_idempotency_key(job, runtime.store.namespace)
        request.idempotency_key = key
        requeues.show_redelivered(request, headers)
        run = _Run(ref, run_id, attempt, headers)
        token = _current.set(run)
        beat = None if atomic_run else heartbeats.start(runtime, ref, run_id)
        try:
            if not atomic_run:
                body = functools.partial(later.run_body, self.run, run.later, args, kwargs)
                result = ends.run(self, delivery, run, body)
                delivery.finish(State.SUCCEEDED, "body returned", carry=True)
                return result
            try:  # (its end, when it returns, committed with its effects)
                body = functools.partial(atomic.run_body, self, delivery, run, args, kwargs)
                return ends.run(self, delivery, run, body)
            except atomic.NotRun as exc:  # nothing of it committed, nothing to write
                raise exc.raised from None
        finally:
            if beat is not None:
                heartbeats.stop(beat)
            _current.reset(token)


def _on_revoked(
    sender: Any = None, request: Any = None, terminated: bool = False, **kw: Any
) -> None:
    """Celery's ``task_revoked``: a gated job's revoke or expiry is recorded (``record_revoke``)."""
    if isinstance(sender, ExactOnceTask) and request is not None:
        record_revoke(sender, request, terminated=terminated, expired=bool(kw.get("expired")))


signals.task_revoked.connect(_on_revoked, weak=False)
