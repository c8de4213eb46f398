"""The reconcile task: what runs a :class:`~celery_exactonce.reconcile.reconciler.Reconciler` pass.

A pass runs as the occurrences of one internal beat entry,
:data:`RECONCILE_TASK` (``exactonce_reconcile_interval``), claimed like any
other so that one node per interval wins it. The node that won runs it:

* in its own thread (:class:`BeatRunner`, ``exactonce_reconcile_on =
  "beat"``, the default), so a busy worker queue cannot delay a pass;
* or as a Celery task on a worker (``"worker"``), registered on the apps that
  use celery-exactonce by :func:`register_task`.

Each process keeps one reconciler per runtime (:func:`reconciler_for`): it
remembers back-offs and the grace after a store outage. The pass itself, and
what it does to each stale job, is :mod:`celery_exactonce.reconcile.reconciler`'s.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from celery_exactonce.core import exceptions, refs
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import Transition
from celery_exactonce.observe import metrics
from celery_exactonce.reconcile.reconciler import Reconciler
from celery_exactonce.runtime import Runtime, runtime_for
from celery_exactonce.task.base import ExactOnceTask

#: The Celery task (and beat entry) that runs a pass.
RECONCILE_TASK = "celery_exactonce.reconcile"
#: Unrecorded ends of reconcile occurrences a beat node keeps to write again (the newest).
OWED_ENDS = 16


_reconcilers: weakref.WeakKeyDictionary[Runtime, Reconciler] = weakref.WeakKeyDictionary()
_reconcilers_lock = threading.Lock()


def reconciler_for(runtime: Runtime) -> Reconciler:
    """The runtime's reconciler (one per process and app: it remembers back-offs and grace)."""
    with _reconcilers_lock:
        reconciler = _reconcilers.get(runtime)
        if reconciler is None:
            reconciler = _reconcilers[runtime] = Reconciler(runtime)
        return reconciler


def _reconcile(task: Any) -> dict[str, Any]:
    """One reconcile pass in a worker (``exactonce_reconcile_on = "worker"``)."""
    return reconciler_for(runtime_for(task.app)).run_pass().as_dict()


def register_task(app: Any) -> Any:
    """Register ``celery_exactonce.reconcile`` on ``app`` (idempotent); return the task.

    Registered only on apps that use celery-exactonce (by beat, and by a
    worker whose app sets ``exactonce_store_url``), never as a shared task: an
    app that merely imports the package gets no gated task.
    """
    task = app.tasks.get(RECONCILE_TASK)
    if task is None:
        task = app.task(
            name=RECONCILE_TASK, base=ExactOnceTask, bind=True, ignore_result=True, shared=False
        )(_reconcile)
    return task


class BeatRunner:
    """Runs the reconcile occurrences a beat node won in that node's own thread.

    ``exactonce_reconcile_on = "beat"`` (the default): a busy worker queue
    cannot delay a pass. The occurrence job goes ``SCHEDULED → RUNNING`` (a
    CAS on the rev the claim returned), the pass runs, and the job ends
    ``SUCCEEDED``. While a pass is still running the next occurrence is
    ``CANCELLED`` (one pass at a time per node; the lease makes it one across
    nodes, or one per shard on a sharded namespace). An end the store could
    not take (an outage) is written again before the next pass, rather than
    left ``RUNNING`` for the reconciler to time out and report.
    """

    def __init__(self, runtime: Runtime, *, threaded: bool = True) -> None:
        self.runtime = runtime
        self.threaded = threaded
        self._thread: threading.Thread | None = None
        #: Ends not yet recorded (``_end``'s requests), oldest first.
        self._owed: list[tuple[JobRef, Transition]] = []
        self._owed_lock = threading.Lock()

    def start(self, job: Job) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._end(job, State.CANCELLED, "the previous pass is still running", expect=job.state)
            return
        if not self.threaded:
            self._run(job)
            return
        self._thread = threading.Thread(
            target=self._run, args=(job,), name="exactonce-reconcile", daemon=True
        )
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self, job: Job) -> None:
        self._record_owed()
        run_id = refs.new_token()
        request = Transition(
            State.RUNNING,
            frozenset({State.SCHEDULED}),
            node=self.runtime.node,
            reason="reconcile pass",
            rev=job.rev,
            attempt=job.attempt,
            new_run_id=run_id,
        )
        try:
            result = self.runtime.store.transition(job.ref, request)
        except exceptions.StoreError as exc:
            metrics.event(
                "reconcile_store_error",
                f"reconcile occurrence {job.ref} not started: {exc}",
                level=logging.WARNING,
                detail="start",
            )
            return  # left SCHEDULED: a later pass replays or fails it visibly
        if not result.applied or result.job is None:
            return
        try:
            report = reconciler_for(self.runtime).run_pass()
        except Exception as exc:  # a bug, not a store error: record it, keep beat alive
            metrics.event(
                "reconcile_failed", "reconcile pass failed", level=logging.ERROR, exc_info=exc
            )
            self._end(result.job, State.FAILED, f"{type(exc).__name__}: {exc}", run_id=run_id)
            return
        self._end(result.job, State.SUCCEEDED, f"pass done: {report.summary()}", run_id=run_id)

    def _end(
        self,
        job: Job,
        state: State,
        reason: str,
        *,
        run_id: str | None = None,
        expect: State | None = None,
    ) -> None:
        request = Transition(
            state,
            frozenset({expect or job.state}),
            node=self.runtime.node,
            reason=reason,
            rev=None if run_id else job.rev,
            run_id=run_id,
        )
        try:
            self.runtime.store.transition(job.ref, request)
        except exceptions.StoreError as exc:
            metrics.event(
                "state_write_failed",
                f"reconcile occurrence {job.ref}: could not record {state} "
                f"(again before the next pass): {exc}",
                level=logging.WARNING,
                job_id=job.ref.id,
                task=job.task,
                state=str(state),
            )
            self._owe([(job.ref, request)])

    def _owe(self, ends: list[tuple[JobRef, Transition]]) -> None:
        with self._owed_lock:
            self._owed = [*self._owed, *ends][-OWED_ENDS:]

    def _record_owed(self) -> None:
        """Write the ends earlier passes could not; keep those the store still refuses."""
        with self._owed_lock:
            owed, self._owed = self._owed, []
        refused = []
        for ref, request in owed:
            try:
                self.runtime.store.transition(ref, request)  # a CAS: applies at most once
            except exceptions.StoreError:
                refused.append((ref, request))
        if refused:
            self._owe(refused)
