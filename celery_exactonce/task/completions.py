"""A run's completion written off the worker's hot path, on stores whose writes wait for a disk.

On PostgreSQL and MySQL/MariaDB every write waits for its commit to be on
disk (~0.3 ms with ``synchronous_commit`` on). A run's ``RUNNING`` write
must: its body runs only once the record says the run owns the job. Its
completion need not hold the worker: where the store says so
(``defers_completions``), :func:`finish` hands the write to one thread of the
process and the task returns at once, so Celery acknowledges, reports the
result and takes the next message while the write commits. The write is the
one :meth:`~celery_exactonce.task.gate.Delivery.finish` makes on the caller's
thread elsewhere: the same statement, commit, retries and log lines.

Before its next body runs, a thread waits for the completions it handed over
(:func:`settle`, after that run's own ``RUNNING`` write, which commits
alongside), so at most one run per thread has its outcome unwritten. A
process that exits normally (a prefork child recycled, a worker stopping)
writes them all first (``worker_process_shutdown``, ``worker_shutdown``,
``atexit``). One killed in between leaves that record ``RUNNING``, as a kill
just after the body always could: the reconciler times it out, and it runs
again only for a task that opted into that. The result backend may say
``SUCCESS`` a moment before the record says ``SUCCEEDED``.

Not here: the gate (:mod:`~celery_exactonce.task.gate`).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from celery import signals

from celery_exactonce.core.states import State
from celery_exactonce.observe import metrics

#: How long a thread waits for its handed-over completions before its next body (or a
#: process for all of them as it exits), past which it goes on and says so.
SETTLE_TIMEOUT = 60.0


class Completions:
    """The completion writer of one process: a thread, started at the first write handed over."""

    def __init__(self) -> None:
        self._pid = -1
        self._lock = threading.Lock()
        self._local = threading.local()
        self._queue: queue.SimpleQueue[tuple[Any, State, str, threading.Event]]
        self._open: set[threading.Event] = set()

    def hand_over(self, delivery: Any, state: State, reason: str) -> None:
        """Have the thread write ``delivery``'s outcome (:meth:`Delivery.finish`)."""
        done = threading.Event()
        with self._lock:
            if self._pid != os.getpid():  # the first here, or a forked child: a thread of its own
                self._pid, self._open, self._local = os.getpid(), set(), threading.local()
                self._queue = queue.SimpleQueue()
                writer = threading.Thread(target=self._write, name="exactonce-completions")
                writer.daemon = True
                writer.start()
            self._open.add(done)
        pending = getattr(self._local, "pending", None)
        if pending is None:
            pending = self._local.pending = []
        pending.append(done)
        self._queue.put((delivery, state, reason, done))

    def settle(self, timeout: float = SETTLE_TIMEOUT) -> bool:
        """Wait until the completions this thread handed over are written (``False``: not
        in time)."""
        pending = getattr(self._local, "pending", None) if self._pid == os.getpid() else None
        while pending:
            if not pending[0].wait(timeout):
                return self._late(len(pending))
            pending.pop(0)
        return True

    def drain(self, timeout: float = SETTLE_TIMEOUT) -> bool:
        """Wait until every completion handed over in this process is written."""
        if self._pid != os.getpid():
            return True
        with self._lock:
            still = list(self._open)
        for done in still:
            if not done.wait(timeout):
                return self._late(sum(not d.is_set() for d in still))
        return True

    def _write(self) -> None:
        while True:
            delivery, state, reason, done = self._queue.get()
            try:
                delivery.finish(state, reason)
            except BaseException as exc:  # logged; the thread goes on with the next
                metrics.event(
                    "completion_write_failed",
                    f"could not record {state} for {delivery.ref}: {exc}",
                    level=logging.ERROR,
                    job_id=delivery.ref.id,
                    exc_info=exc,
                )
            finally:
                with self._lock:
                    self._open.discard(done)
                done.set()

    @staticmethod
    def _late(count: int) -> bool:
        metrics.event(
            "completions_late",
            f"{count} completion write(s) still unwritten after {SETTLE_TIMEOUT:g} s; going on",
            level=logging.WARNING,
        )
        return False


#: This process's completion writer.
COMPLETIONS = Completions()


def enter(delivery: Any, args: Sequence[Any], kwargs: Mapping[str, Any], *, brief: bool) -> Any:
    """Pass the gate (:meth:`Delivery.enter`), then wait for this thread's last outcomes to be
    written: the body runs once they are (its ``RUNNING`` write committed alongside them)."""
    job = delivery.enter(args, kwargs, brief=brief)
    COMPLETIONS.settle()
    return job


def finish(delivery: Any, state: State, reason: str) -> None:
    """Write ``delivery``'s outcome: handed to the process's thread where the store defers
    completions and the run is a worker's; else at once (:meth:`Delivery.finish`)."""
    store = delivery.runtime.store
    if getattr(store, "defers_completions", False) is True and not delivery.task.request.is_eager:
        COMPLETIONS.hand_over(delivery, state, reason)
    else:
        delivery.finish(state, reason)


def _drain(**_: Any) -> None:
    COMPLETIONS.drain()


signals.worker_process_shutdown.connect(_drain, weak=False)
signals.worker_shutdown.connect(_drain, weak=False)
atexit.register(COMPLETIONS.drain)
