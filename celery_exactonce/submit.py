"""A submit's record: the job created in the store, or the one already there, judged.

``ExactOnceTask.apply_async`` builds the job a call makes (a
:class:`~celery_exactonce.writes.NewJob`), then writes it here, with plain
functions of the process's runtime:

* :func:`enqueue`: the one-step submit (record and message in one store call)
  where the broker shares the store's Redis, or ``None``;
* :func:`create`: create if absent, reading the record back once if the
  answer is lost; a record it cannot tell raises ``SubmitAmbiguous``;
* :func:`resubmitted`: a ``task_id`` submitted again is the same job (logged
  and counted, not run again) or a ``JobConflict``;
* :func:`after_commit`: where the store wrote the job inside the caller's open
  transaction (the ``django://`` store), how to dispatch it once that commits.

Not here: what a call's options become in the job
(:mod:`~celery_exactonce.call_options`), building the job and dispatching it,
and what Celery's ``apply_async`` does around it (:mod:`~celery_exactonce.task`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any

from celery_exactonce import call_options, exceptions, jobs, metrics
from celery_exactonce.jobs import CreateStatus, Job
from celery_exactonce.outcomes import Enqueued
from celery_exactonce.runtime import Runtime
from celery_exactonce.stores import settle
from celery_exactonce.writes import NewJob


def enqueue(runtime: Runtime, new: NewJob, call: Mapping[str, Any]) -> Enqueued | None:
    """The one-call submit where the broker shares the store's Redis, or ``None``."""
    try:
        return runtime.dispatcher.enqueue(new, reason="apply_async", call=call)
    except exceptions.StoreError as exc:
        raise exceptions.SubmitAmbiguous(new.ref.id) from exc


def create(runtime: Runtime, new: NewJob) -> Job:
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
        resubmitted(job, new)
    return job


def resubmitted(job: Job, new: NewJob) -> None:
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
