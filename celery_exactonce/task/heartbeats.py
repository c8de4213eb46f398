"""The heartbeat thread of a worker process: it touches every running gated job.

A gated run registers when its body starts (:meth:`Heartbeats.start`) and
leaves when it ends; the thread writes each run's heartbeat every
``exactonce_heartbeat_interval``, so the reconciler can tell a long body from
a vanished worker. It also runs a call at a time asked (:meth:`Heartbeats.call_at`:
the outcomes a worker carries that no gate took, :mod:`~celery_exactonce.task.outcomes`).
Not here: the gate itself (:mod:`~celery_exactonce.task.gate`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable

from celery_exactonce.core import exceptions
from celery_exactonce.core.refs import JobRef, process_id
from celery_exactonce.observe import metrics
from celery_exactonce.runtime import Runtime


@dataclasses.dataclass
class _Beating:
    """One run the heartbeat thread touches."""

    runtime: Runtime
    ref: JobRef
    run_id: str
    due: float  # monotonic


class Heartbeats:
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
        #: What the thread runs once, each when (:meth:`call_at`).
        self._calls: dict[Callable[[], None], float] = {}

    def start(self, runtime: Runtime, ref: JobRef, run_id: str) -> int:
        """Touch ``ref`` under ``run_id`` every interval from now on; the token to stop it."""
        due = time.monotonic() + runtime.config.heartbeat_interval
        with self._lock:
            self._started()
            token = next(self._tokens)
            self._runs[token] = _Beating(runtime, ref, run_id, due)
            if due < self._wakes_at:
                self._lock.notify()
        return token

    def call_at(self, when: float, call: Callable[[], None]) -> None:
        """Have the thread run ``call`` once at ``when`` (monotonic), or at the earlier time
        it was asked to run it already."""
        with self._lock:
            self._started()
            at = min(when, self._calls.get(call, when))
            self._calls[call] = at
            if at < self._wakes_at:
                self._lock.notify()

    def _started(self) -> None:
        """The thread, started (under the lock) in this process: the first use here, or a
        forked child's."""
        if self._pid != process_id():
            self._pid, self._runs, self._calls, self._wakes_at = process_id(), {}, {}, -math.inf
            threading.Thread(target=self._loop, name="exactonce-heartbeat", daemon=True).start()

    def stop(self, token: int) -> None:
        with self._lock:
            self._runs.pop(token, None)

    def _loop(self) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                due = [(token, run) for token, run in self._runs.items() if run.due <= now]
                calls = [call for call, at in self._calls.items() if at <= now]
                for call in calls:
                    del self._calls[call]
                if not due and not calls:
                    nearest = min((run.due for run in self._runs.values()), default=now + 60.0)
                    nearest = min(nearest, *self._calls.values()) if self._calls else nearest
                    self._wakes_at = nearest
                    self._lock.wait(timeout=nearest - now)
                    self._wakes_at = -math.inf  # not waiting: it looks at every run before it does
                    continue
                for _, run in due:
                    run.due = now + run.runtime.config.heartbeat_interval
            for call in calls:
                self._run_call(call)
            for token, run in due:
                if not self._beat(run):
                    self.stop(token)

    @staticmethod
    def _run_call(call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as exc:  # logged: the thread goes on beating
            metrics.event(
                "heartbeat_failed",
                f"the heartbeat thread's call failed: {exc}",
                level=logging.WARNING,
                exc_info=exc,
            )

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


#: The process's heartbeat thread, shared by every gated run of the process.
heartbeats = Heartbeats()
