"""A submit's record: the job created in the store, or the one already there, judged.

``ExactOnceTask.apply_async`` builds the job a call makes (a
:class:`~celery_exactonce.core.writes.NewJob`), then writes it here, with plain
functions of the process's runtime:

* :func:`before_send`: what Celery's ``apply_async`` does before it sends;
* :func:`new_job`: the job a call makes, from what Celery's ``apply_async``
  would have sent;
* :func:`enqueue`: the one-write submit (the record written ``DISPATCHED`` by
  one store call, with the message where the broker shares the store's
  Redis), or ``None``;
* :func:`create`: create if absent, reading the record back once if the
  answer is lost; a record it cannot tell raises ``SubmitAmbiguous``;
* :func:`resubmitted`: a ``task_id`` submitted again is the same job (logged
  and counted, not run again) or a ``JobConflict``; :func:`republishes`: the
  job found ``DISPATCHED`` with no proof its message left is published again;
* :func:`result_of`: the ``AsyncResult`` of a job not published now;
* :func:`after_commit`: where the store wrote the job inside the caller's open
  transaction (the ``django://`` store), how to dispatch it once that commits.

Not here: what a call's options become in the job
(:mod:`~celery_exactonce.task.call_options`), building the job and dispatching it,
and what Celery's ``apply_async`` does around it (:mod:`~celery_exactonce.task.base`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from celery_exactonce.core import exceptions, jobs
from celery_exactonce.core.jobs import CreateStatus, Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import UNIQUE_OPTION, NewJob
from celery_exactonce.dispatch import messages
from celery_exactonce.dispatch.one_step import ENQUEUED
from celery_exactonce.dispatch.outcomes import Enqueued
from celery_exactonce.observe import metrics, traces
from celery_exactonce.policy import task_policy
from celery_exactonce.runtime import Runtime
from celery_exactonce.stores import settle
from celery_exactonce.task import call_options, unique


def before_send(
    task: Any,
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
    if task.soft_time_limit and task.time_limit and task.soft_time_limit > task.time_limit:
        raise ValueError("soft_time_limit must be less than or equal to time_limit")
    if task.typing:
        check = getattr(task, "__header__", None)
        if check is not None:
            check(*(args or ()), **(kwargs or {}))
    shadow = shadow or task.shadow_name(args, kwargs, options)
    merged = {**task._get_exec_options(), **options}
    dump = getattr(task, "_dump_pydantic_arguments", None)
    if dump is not None and merged.get("serializer") != "pickle":
        args, kwargs = dump(args, kwargs)
    merged.setdefault("ignore_result", task.ignore_result)
    return args, kwargs, shadow, merged


def result_of(task: Any, task_id: str, call: Mapping[str, Any], options: Mapping[str, Any]) -> Any:
    """The ``AsyncResult`` ``send_task`` would have returned, for a job not published now."""
    ignore_result = bool(options.get("ignore_result"))
    result = call["result_cls"](task_id)
    result.ignored = ignore_result
    if not ignore_result:
        with task.app.producer_or_acquire(None) as producer:
            task.app.backend.on_task_call(producer, task_id)
    parent = task.app.current_worker_task if call["add_to_parent"] else None
    if parent is not None:
        parent.add_trail(result)
    return result


def new_job(
    task: Any,
    node: str,
    task_id: str,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    *,
    link: Any,
    link_error: Any,
    shadow: str | None,
    options: Mapping[str, Any],
    eager: bool = False,
) -> NewJob:
    """The job an ``apply_async`` of gated ``task`` makes (``options`` as Celery's own).

    ``PENDING`` until its ``eta`` when that is in the future, else
    ``SCHEDULED``. ``eager``: the call runs in this process now, as Celery's
    eager mode runs it whatever its ``eta`` (never ``PENDING``).

    Raises
    ------
    InvalidPayload
        An option the dispatch path sets itself, or a payload not storable as JSON.
    """
    stored = call_options.storable_options(options)
    messages.check_options(stored, context=f"{task.name}.apply_async")
    for name, value in (("link", link), ("link_error", link_error)):
        if value is not None:
            stored[name] = [dict(s) for s in (value if isinstance(value, list) else [value])]
    if shadow is not None:
        stored["shadow"] = shadow
    # Results sent by the reply_to backend (rpc://) go to the caller, not to the
    # process that publishes the job when it falls due.
    stored.setdefault("reply_to", task.app.thread_oid)
    ref = JobRef.submitted(task_id)
    nesting = int(options.get("replaced_task_nesting") or 0)
    if nesting:  # a replacement (Task.replace) takes the id of the job it replaces
        ref = JobRef.submitted(messages.replacement_job_id(task_id, nesting))
        stored[messages.MESSAGE_ID_OPTION] = task_id
    eta = call_options.eta_of(options)
    delayed = not eager and eta is not None and eta > datetime.now(timezone.utc)
    stored[messages.GATED_OPTION] = True
    stored[messages.POLICY_OPTION] = task_policy(task)
    # A replacement stands in for the job it replaces (which may hold the key itself).
    key = None if eager or nesting else unique.key_of(task, args, kwargs)
    if key is not None:
        stored[UNIQUE_OPTION] = key
    carrier = traces.capture()
    if carrier is not None:  # the submitter's trace goes on wherever the job is published
        stored[traces.TRACE_OPTION] = carrier
    reason = "apply_async (eager)" if eager else "apply_async"
    return NewJob(
        ref,
        task.name,
        State.PENDING if delayed else State.SCHEDULED,
        node=node,
        args=list(args or ()),
        kwargs=dict(kwargs or {}),
        options=stored,
        run_at=eta if delayed else None,
        deadline=call_options.deadline_of(options.get("expires")),
        reason=f"{reason} (delayed)" if delayed else reason,
    )


def enqueue(runtime: Runtime, new: NewJob, call: Mapping[str, Any]) -> Enqueued | None:
    """The one-write submit (``Dispatcher.enqueue``), or ``None``.

    ``None`` inside a caller's transaction on the store's database (``django://``
    in ``transaction.atomic()``): the job is written there ``SCHEDULED`` and
    dispatched once that commits, so that a crash in between leaves it for
    the reconciler to replay, never ``DISPATCHED`` with no message.
    """
    if after_commit(runtime) is not None:
        return None
    try:
        return runtime.dispatcher.enqueue(new, reason="apply_async", call=call)
    except exceptions.StoreError as exc:
        raise exceptions.SubmitAmbiguous(new.ref.id) from exc


def create(runtime: Runtime, new: NewJob) -> Job:
    """Create ``new`` (one read back if the answer is lost: the caller resubmits).

    Brief: a created record is not sent back, it is ``new`` as created, on
    this process's clock (as a brief ``DISPATCHED`` write computes its
    record), but where a signing key is set (the store signs the record).
    A job that exists is read. A unique submission (``new.unique``) whose key
    a live job holds gets that job (another ``ref``), nothing created.
    """
    brief = runtime.dispatcher.signer is None and new.unique is None
    if new.unique is not None:
        result = settle.create_unique(runtime.store, new, tries=1)
        if result.status is CreateStatus.UNIQUE_HELD and result.job is not None:
            unique_hit(result.job, new)
            return result.job
    else:
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
        resubmitted(job, new)
    return job


def unique_hit(holder: Job, new: NewJob) -> None:
    """A unique submission answered by the live job that holds its key (logged, counted).

    A warning when the call brought links or a canvas of its own: they are not the
    holder's, and do not run.
    """
    brought = ("link", "link_error", *call_options.CANVAS_OPTIONS)
    dropped = [name for name in brought if new.options.get(name)]
    metrics.event(
        "unique_hit",
        "%s submitted while job %s (%s) holds its unique key: that job is the answer, "
        "no job created" + (f"; the call's {', '.join(dropped)} not attached" if dropped else ""),
        new.task,
        holder.ref.id,
        holder.state,
        level=logging.WARNING if dropped else logging.DEBUG,
        job_id=holder.ref.id,
        task=new.task,
        state=str(holder.state),
    )


def republishes(job: Job) -> bool:
    """Whether a resubmission publishes ``job`` again: gated, ``DISPATCHED``, no proof it left.

    The one proof a message left while its record is ``DISPATCHED`` is a
    record written with its message in one step (the Redis one-step submit);
    after any other ``DISPATCHED`` write (one write before a publish that may
    have failed, or never run), the message may be missing, and the job would
    wait for the reconciler's deadline. The gate drops the extra copy where
    the first one did land.
    """
    if job.state is not State.DISPATCHED or not job.options.get(messages.GATED_OPTION):
        return False
    last = next((entry for entry in reversed(job.history) if entry.dst is job.state), None)
    return last is None or ENQUEUED not in last.reason


def resubmitted(job: Job, new: NewJob) -> None:
    """A ``task_id`` submitted again: the same job (logged, counted), or a conflict.

    The same task and payload is the same job: it is not run again (a frozen
    signature applied twice runs once). Another task or payload, or the
    same one in another group, chord or chain (a frozen signature reused in a
    second canvas, which would wait forever for a part that never runs
    again), is refused with :class:`~celery_exactonce.core.exceptions.JobConflict`.
    """
    if (job.task, job.args, job.kwargs) != (new.task, new.args, new.kwargs):
        raise exceptions.JobConflict(
            f"task_id {new.ref.id!r} already exists as {job.task} with another payload"
        )
    differ = [
        name
        for name in call_options.CANVAS_OPTIONS
        if call_options.canvas(new.options, name) != call_options.canvas(job.options, name)
    ]
    if differ:
        raise exceptions.JobConflict(
            f"task_id {new.ref.id!r} already exists as a part of another canvas (its "
            f"{differ[0]} differs): a frozen signature runs in one canvas only; build the "
            "signature again for each canvas"
        )
    metrics.event(
        "resubmitted",
        f"{job.task} {new.ref.id} submitted again: the existing job "
        f"({job.state}) stands, not run again",
        job_id=new.ref.id,
        task=job.task,
        state=str(job.state),
    )


def after_commit(runtime: Runtime) -> Callable[[Callable[[], None]], None] | None:
    """How to run a function once the caller's transaction commits, if the job is in one.

    Only a store that writes in the caller's transaction (``django://`` inside
    ``transaction.atomic()``) says so; every other store commits each write at
    once, and this is ``None``.
    """
    hook = getattr(runtime.store, "after_commit", None)
    if hook is None:
        return None
    registrar: Callable[[Callable[[], None]], None] | None = hook()
    return registrar
