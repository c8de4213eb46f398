"""FrozenClock: a clock that moves only when a test moves it.

Give it to an :class:`~celery_exactonce.stores.memory.InMemoryStore` (or
anything that takes a :class:`~celery_exactonce.core.clock.Clock`) for a store
time that tests control without sleeping.
"""

from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone

from celery_exactonce.core import times

__all__ = ["FrozenClock"]


class FrozenClock:
    """A thread-safe clock that stands still until :meth:`advance` or :meth:`set`."""

    def __init__(self, start: datetime | None = None) -> None:
        initial = start or datetime(2026, 1, 1, tzinfo=timezone.utc)
        self._now = times.require_aware(initial, "start")
        self._lock = threading.Lock()

    def now(self) -> datetime:
        with self._lock:
            return self._now

    def advance(self, seconds: float = 0.0, **delta: float) -> datetime:
        """Move forward by ``seconds`` (plus any :class:`~datetime.timedelta` keywords)."""
        with self._lock:
            self._now += timedelta(seconds=seconds, **delta)
            return self._now

    def set(self, instant: datetime) -> None:
        """Jump to ``instant`` (backwards too: clocks do step back)."""
        with self._lock:
            self._now = times.require_aware(instant, "instant")
