"""A run's outcome: written after its body, or carried to its thread's next gate write.

:func:`write` writes a run's outcome (``RUNNING →`` ``SUCCEEDED``, ``FAILED``
or ``CANCELLED``) on its run id, retried, and notes a late one (the run no
longer owns the job) without changing the state.

In a worker started by ``celery worker``, a busy thread's body's return is
*carried* (:func:`finish`): the task returns at once, and its ``SUCCEEDED``
goes with the next write of the gate on the same thread, in the same store
call (:func:`cas`): one round trip for both, and on PostgreSQL one commit. A
busy worker so writes once per run, not twice. A thread is busy when its last
gate write came within :data:`CARRY_FOR` of the run before it: an idle one
writes at once (carried, its outcome would only wait for the heartbeat
thread). Every other outcome (``FAILED``, ``CANCELLED``, a replaced run) is
written at once, before Celery stores the result. An outcome no gate took
within :data:`CARRY_FOR` (the worker went idle) is written by the process's
heartbeat thread, and a process that exits normally writes
the ones it carries first (``worker_process_shutdown``, ``worker_shutdown``,
``atexit``). Before a run's body starts, the outcome of the run before it on
its thread is written: the gate took it, or :func:`cas` wrote it first.

A process killed while it carries an outcome leaves that job ``RUNNING``, as a
kill just after a body always could: the reconciler ends it ``TIMEOUT``, and
it never runs again unless its task opted into re-runs. The result backend
may show ``SUCCESS`` up to :data:`CARRY_FOR` before the record shows
``SUCCEEDED``. Outside a ``celery worker`` process (an eager run, a test's
in-process worker, a task called directly) every outcome is written at once.

Not here: the gate (:mod:`~celery_exactonce.task.gate`).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any

from celery import signals

from celery_exactonce.core import exceptions, refs
from celery_exactonce.core.jobs import Job, TransitionResult
from celery_exactonce.core.refs import JobRef, process_id
from celery_exactonce.core.writes import Transition
from celery_exactonce.observe import metrics
from celery_exactonce.runtime import Runtime
from celery_exactonce.stores import settle
from celery_exactonce.task.heartbeats import heartbeats

#: Seconds an outcome waits for its thread's next gate write before the heartbeat thread
#: writes it.
CARRY_FOR = 0.02


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A run's outcome, to write: its job, its ``RUNNING →`` end transition, for the logs."""

    runtime: Runtime
    ref: JobRef
    request: Transition
    task: str
    #: The message's entry key header, for the error event (``None``: none).
    key: str | None = None


def write(outcome: Outcome) -> None:
    """Write ``outcome`` on its run id, retried; a late one is noted."""
    runtime, ref, request = outcome.runtime, outcome.ref, outcome.request
    delay = runtime.config.retry_delay_store
    error: BaseException | None = None
    for _ in range(3):
        # Brief: an applied outcome needs no record back; a refused one carries it.
        result = settle.transition(runtime.store, ref, request, brief=True)
        if result.error is not None and not result.applied:
            error = result.error
            time.sleep(delay)
            continue
        _answered(outcome, result.applied, result.job)
        return
    metrics.event(
        "completion_write_failed",
        f"could not record {request.to} for {ref}; the reconciler will resolve it",
        level=logging.ERROR,
        labels={"state": str(request.to)},
        sentry=True,
        job_id=ref.id,
        task=outcome.task,
        key=outcome.key,
        exc_info=error,
    )


def _answered(outcome: Outcome, applied: bool, job: Job | None) -> None:
    """What an answered outcome write means: done, or late (noted, never a change of state)."""
    ref, state = outcome.ref, outcome.request.to
    if applied:
        metrics.event(
            "completed",
            "job %s ended %s",
            ref,
            state,
            level=logging.DEBUG,
            labels={"state": state.value},
            task=outcome.task,
            key=outcome.key,
        )
        return
    # The run no longer owns the job (the reconciler timed it out, a revoke cancelled
    # it): the outcome is late and changes nothing, but the record says it.
    current = job.state if job else "no record"
    metrics.event(
        "late_outcome",
        f"late outcome {state} of {ref} ignored: the job is {current}",
        level=logging.WARNING,
        job_id=ref.id,
        task=outcome.task,
        state=str(state),
    )
    if job is not None:
        runtime, request = outcome.runtime, outcome.request
        note = f"late outcome of run {request.run_id}: {state} ({request.reason}); not applied"
        with contextlib.suppress(exceptions.StoreError):  # the warning above stands
            runtime.store.annotate(ref, node=runtime.node, reason=note, op_id=refs.new_token())


def cas(runtime: Runtime, ref: JobRef, write_: Transition, brief: bool) -> TransitionResult:
    """The gate's compare-and-swap ``write_`` on ``ref``, this thread's carried outcome (on
    the same store) in the same call: ``write_``'s answer, once the outcome is written."""
    carried = CARRIED.take(runtime)
    if carried is not None and not brief:  # the gate wants the record: written first
        write(carried)
        carried = None
    if carried is None:
        (result,) = runtime.store.transition_many([(ref, write_)], brief=brief)
        return result
    try:
        ended, result = runtime.store.transition_many(
            [(carried.ref, carried.request), (ref, write_)], brief=True
        )
    except exceptions.StoreError:
        back = settle.read_back(runtime.store, carried.ref, carried.request.new_rev, tries=1)
        if back.decision in (settle.Decision.APPLIED, settle.Decision.SUPERSEDED):
            _answered(carried, True, back.job)
        else:  # not written, or unknown: written now, retried (the gate reads its own back)
            write(carried)
        raise
    _answered(carried, ended.applied, ended.job)
    return result


class Carried:
    """The outcomes this process carries, one per thread at most, each until its due time;
    and, per thread, whether it is busy (its last gate write came within :data:`CARRY_FOR`
    of the run before it: only then is an outcome carried)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = process_id()
        self._slots: dict[int, tuple[Outcome, float]] = {}
        #: When each thread's last run ended (monotonic), until its next gate write.
        self._ended: dict[int, float] = {}
        #: The threads whose last gate write came within CARRY_FOR of the run before.
        self._busy: set[int] = set()
        #: Set in a ``celery worker`` process (its signal), and so in its pool's forked
        #: children: only there are outcomes carried.
        self.enabled = False

    def _here(self) -> None:
        """(Under the lock.) A forked child's first call: its parent's state is not its own."""
        if self._pid != process_id():
            self._pid, self._slots, self._ended, self._busy = process_id(), {}, {}, set()

    def finish(self, outcome: Outcome, *, carry: bool) -> None:
        """Carry ``outcome`` if ``carry`` and this thread is busy (one carried before it is
        written), else write it now; note when the thread's run ended either way."""
        thread = threading.get_ident()
        before = None
        with self._lock:
            self._here()
            carry = carry and thread in self._busy
            if carry:
                due = time.monotonic() + CARRY_FOR
                before = self._slots.pop(thread, None)
                self._slots[thread] = (outcome, due)
        if carry:
            heartbeats.call_at(due, self.flush)
        else:
            write(outcome)
        if before is not None:
            write(before[0])
        with self._lock:
            self._ended[thread] = time.monotonic()

    def take(self, runtime: Runtime) -> Outcome | None:
        """This thread's carried outcome, if it is one of ``runtime``'s (another's: written);
        the thread is busy if this gate write comes within :data:`CARRY_FOR` of its last run."""
        thread = threading.get_ident()
        with self._lock:
            self._here()
            ended = self._ended.pop(thread, None)
            if ended is not None and time.monotonic() - ended < CARRY_FOR:
                self._busy.add(thread)
            elif ended is not None:
                self._busy.discard(thread)
            slot = self._slots.pop(thread, None) if self._slots else None
        if slot is None or slot[0].runtime is runtime:
            return None if slot is None else slot[0]
        write(slot[0])
        return None

    def flush(self, *, every: bool = False) -> None:
        """Write the outcomes past their due time (``every``: all of them)."""
        now = time.monotonic()
        with self._lock:
            if self._pid != process_id():
                return
            due = [k for k, (_, at) in self._slots.items() if every or at <= now]
            taken = [self._slots.pop(k)[0] for k in due]
            left = min((at for _, at in self._slots.values()), default=None)
        for outcome in taken:
            write(outcome)
        if left is not None:
            heartbeats.call_at(left, self.flush)


#: This process's carried outcomes.
CARRIED = Carried()


def finish(outcome: Outcome, *, carry: bool) -> None:
    """Write ``outcome`` now, or (``carry``, in a busy thread of a ``celery worker``
    process) carry it to the thread's next gate write."""
    if CARRIED.enabled:
        CARRIED.finish(outcome, carry=carry)
    else:
        write(outcome)


def write_carried(runtime: Runtime) -> None:
    """Write this thread's carried outcome now, if it has one (before a transaction that
    must not take it along: the atomic gate's)."""
    carried = CARRIED.take(runtime)
    if carried is not None:
        write(carried)


def _in_worker(**_: Any) -> None:
    CARRIED.enabled = True


def _exiting(**_: Any) -> None:
    CARRIED.flush(every=True)


# ``celeryd_init`` is sent by ``celery worker`` alone, before its pool starts (a prefork
# child inherits the flag): not by a worker a test builds in its own process, whose solo
# pool sends ``worker_process_init`` all the same.
signals.celeryd_init.connect(_in_worker, weak=False)
signals.worker_process_shutdown.connect(_exiting, weak=False)
signals.worker_shutdown.connect(_exiting, weak=False)
atexit.register(_exiting)
