"""Background retries of dispatches that failed closed or were rolled back.

A dispatch whose ``DISPATCHED`` write failed (fail closed) or whose publish
failed definitely (rolled back) leaves its job ``SCHEDULED``. The
:class:`Retrier` tries it again from a thread of its own, with back-off, for
a bounded time; past that the reconciler replays it. Not here: the dispatch
itself (:mod:`~celery_exactonce.dispatch.dispatcher`).
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from typing import Protocol

from celery_exactonce.core import exceptions
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.dispatch.outcomes import DispatchResult, Outcome
from celery_exactonce.observe import metrics
from celery_exactonce.stores.base import StateStore


class Redispatcher(Protocol):
    """What the retrier needs of the dispatcher it is bound to."""

    store: StateStore

    def dispatch(self, job: Job, *, reason: str = ..., retry: bool = ...) -> DispatchResult: ...


class Retrier:
    """Retries, in a background thread, dispatches that failed closed or were rolled back.

    Each job is retried with exponential back-off (``first_delay`` doubling up
    to ``max_delay``) for at most ``give_up_after`` seconds; past that, or if
    this process exits, the reconciler replays the ``SCHEDULED`` job. A retry
    re-reads the record and dispatches it only while it is still
    ``SCHEDULED``, so it never publishes a job someone else has moved on.
    """

    def __init__(
        self, first_delay: float = 1.0, max_delay: float = 30.0, give_up_after: float = 300.0
    ) -> None:
        self.first_delay = first_delay
        self.max_delay = max_delay
        self.give_up_after = give_up_after
        self._lock = threading.Condition()
        self._queue: list[tuple[float, int, JobRef, float, float]] = []
        self._seq = 0
        self._thread: threading.Thread | None = None
        self._dispatcher: Redispatcher | None = None

    def bind(self, dispatcher: Redispatcher) -> None:
        self._dispatcher = dispatcher

    def schedule(
        self, ref: JobRef, delay: float | None = None, *, started: float | None = None
    ) -> None:
        """Retry the dispatch of ``ref`` after ``delay`` seconds."""
        now = time.monotonic()
        delay = self.first_delay if delay is None else delay
        with self._lock:
            self._seq += 1
            heapq.heappush(self._queue, (now + delay, self._seq, ref, delay, started or now))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="exactonce-dispatch-retry", daemon=True
                )
                self._thread.start()
            self._lock.notify()

    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue or self._queue[0][0] > time.monotonic():
                    timeout = self._queue[0][0] - time.monotonic() if self._queue else 60.0
                    if not self._lock.wait(timeout=max(timeout, 0.0)) and not self._queue:
                        return  # idle for a minute: the thread ends, schedule() restarts it
                _, _, ref, delay, started = heapq.heappop(self._queue)
            self._retry(ref, delay, started)

    def _retry(self, ref: JobRef, delay: float, started: float) -> None:
        dispatcher = self._dispatcher
        if dispatcher is None:
            return
        try:
            job = dispatcher.store.get(ref)
        except exceptions.StoreError:
            job = None
            outcome = Outcome.FAIL_CLOSED
        else:
            if job is None or job.state is not State.SCHEDULED:
                return
            outcome = dispatcher.dispatch(job, reason="dispatch retry", retry=False).outcome
        if outcome in (Outcome.FAIL_CLOSED, Outcome.ROLLED_BACK):
            if time.monotonic() - started + delay < self.give_up_after:
                self.schedule(ref, min(delay * 2, self.max_delay), started=started)
            else:
                metrics.event(
                    "dispatch_retry_gave_up",
                    f"gave up retrying the dispatch of {ref}; the reconciler replays it",
                    level=logging.WARNING,
                    job_id=ref.id,
                )
