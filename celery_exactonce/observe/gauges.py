"""What beat's gauges read: the store's counts, read off the hot path, and the node's own times.

Nothing here imports ``prometheus-client``: :mod:`celery_exactonce.observe.prometheus`
turns these values into metrics on each scrape.

* :class:`StoreGauges`: the records per state and the due backlog
  (:meth:`StateStore.count_by_state`, :meth:`StateStore.due_backlog`), and on
  beat each entry's health (:mod:`~celery_exactonce.observe.entry_health`), read
  by one thread of its own when a scrape finds them older than ``max_age``.
  A scrape waits for a read at most ``wait`` seconds and otherwise serves the
  last one; so neither a slow store nor many scrapes load the store or slow
  a tick. A read that fails is an event (``metrics_store_error``) and a
  snapshot with its ``error``: beat and the scrape go on.
* :class:`BeatGauges`: when each tick of this beat ended (wall time), and how
  long since the last reconcile pass this process ran.

Not here: the metrics and the HTTP endpoint (:mod:`celery_exactonce.observe.prometheus`),
the event counters (:mod:`celery_exactonce.observe.metrics`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator

from celery_exactonce.core import exceptions
from celery_exactonce.core.states import State
from celery_exactonce.observe import metrics
from celery_exactonce.observe.entry_health import EntryHealth, EntryHealthReader
from celery_exactonce.stores.base import DueBacklog, StateStore

#: Seconds a read of the store's counts is served before a scrape reads again.
MAX_AGE = 5.0
#: Seconds a scrape waits for a read of the store before it serves the last one.
WAIT = 3.0


@dataclasses.dataclass(frozen=True)
class StoreSnapshot:
    """One read of the store's counts; ``error`` set (and nothing else) when it failed."""

    taken: float
    """``time.monotonic()`` when the read ended."""
    counts: dict[State, int] | None = None
    backlog: DueBacklog | None = None
    error: str | None = None
    entries: tuple[EntryHealth, ...] = ()
    """Each beat entry's health, when the gauges have an :class:`EntryHealthReader`."""


class StoreGauges:
    """The store's counts for the gauges, read by a thread of its own, at most every ``max_age``.

    One thread for the life of the reader (one store connection: a Django
    store opens one per thread), started by the first :meth:`read`.
    """

    def __init__(
        self,
        store: StateStore,
        *,
        max_age: float = MAX_AGE,
        wait: float = WAIT,
        monotonic: Callable[[], float] = time.monotonic,
        health: EntryHealthReader | None = None,
    ) -> None:
        self.store = store
        self.health = health
        self.max_age = max_age
        self.wait = wait
        self._monotonic = monotonic
        self._cond = threading.Condition()
        self._snapshot: StoreSnapshot | None = None
        self._wanted = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def read(self) -> StoreSnapshot | None:
        """The newest snapshot, after asking for a new one if it is older than ``max_age``.

        Waits up to ``wait`` seconds for that read; ``None`` before the first
        read ever ended.
        """
        with self._cond:
            if self._closed or self._fresh():
                return self._snapshot
            self._wanted = True
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="exactonce-metrics", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()
            self._cond.wait_for(self._fresh, timeout=self.wait)
            return self._snapshot

    def close(self) -> None:
        """Stop the thread (a read in flight ends on its own)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _fresh(self) -> bool:
        snapshot = self._snapshot
        return snapshot is not None and self._monotonic() - snapshot.taken < self.max_age

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._wanted or self._closed)
                if self._closed:
                    return
                self._wanted = False
            snapshot = self._take()
            with self._cond:
                self._snapshot = snapshot
                self._cond.notify_all()

    def _take(self) -> StoreSnapshot:
        try:
            counts = self.store.count_by_state()
            backlog = self.store.due_backlog()
            entries = () if self.health is None else tuple(self.health.read())
        except Exception as exc:  # a store error (or a bug) must not end the thread
            level = logging.WARNING if isinstance(exc, exceptions.StoreError) else logging.ERROR
            metrics.event(
                "metrics_store_error",
                "the gauges could not read the store: %s",
                exc,
                level=level,
                exc_info=None if isinstance(exc, exceptions.StoreError) else exc,
            )
            return StoreSnapshot(self._monotonic(), error=f"{type(exc).__name__}: {exc}")
        return StoreSnapshot(self._monotonic(), counts, backlog, entries=entries)


def one_line(error: BaseException) -> str:
    """``error``'s text on one line (a store's error may span several)."""
    return " ".join(str(error).split())


class BeatGauges:
    """This beat node's times: its ticks, whether they reached the store, its reconciler's
    last pass.

    ``store_errors`` gives the monotonic time of the process's last store error
    (:attr:`Runtime.store_error_at <celery_exactonce.runtime.Runtime.store_error_at>`):
    a tick during which one came did not fully reach the store.
    """

    def __init__(
        self,
        node: str,
        *,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        store_errors: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.node = node
        self._wall, self._monotonic, self._store_errors = wall, monotonic, store_errors
        self.started = wall()
        #: Wall time the last tick ended (``None``: none yet), for the metric.
        self.last_tick: float | None = None
        #: Monotonic times: the start, the last tick's end, the tick in progress's start.
        self.started_at = monotonic()
        self.ended_at: float | None = None
        self.began_at: float | None = None
        #: Whether the last tick reached the store (``None``: no tick yet), and why not.
        self.store_reached: bool | None = None
        self.store_error = ""

    @contextlib.contextmanager
    def ticking(self) -> Iterator[None]:
        """Around a tick: when it began and ended, and whether a store call failed in it."""
        began = self.began_at = self._monotonic()
        try:
            yield
        finally:
            self.last_tick, self.ended_at, self.began_at = self._wall(), self._monotonic(), None
            failed = self._store_errors()
            if self.store_reached and failed is not None and failed >= began:
                self.store_reached = False
                self.store_error = "a store call failed during it (fail_closed in beat's log)"

    def reached(self, error: BaseException | None = None) -> None:
        """This tick reached the store (``error``: it could not)."""
        self.store_reached = error is None
        self.store_error = "" if error is None else one_line(error)

    def since_tick(self) -> tuple[str, float]:
        """The last sign of a tick, and how many seconds ago it was (on the monotonic clock)."""
        now = self._monotonic()
        if self.began_at is not None:
            return "the tick in progress began", now - self.began_at
        if self.ended_at is not None:
            return "the last tick ended", now - self.ended_at
        return "no tick yet; started", now - self.started_at

    def reconcile_lag(self) -> float:
        """Seconds since this process last finished a reconcile pass (or started, if none)."""
        last = metrics.last_reconcile_pass()
        return max(0.0, self._wall() - (self.started if last is None else last))
