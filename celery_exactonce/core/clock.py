"""Clocks: where "now" comes from, so tests can freeze it.

Stores that have no server clock of their own (the in-memory store) take a
:class:`Clock`; everything else asks the store (:meth:`StateStore.now`).
:class:`~celery_exactonce.testing.FrozenClock` is the test double.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Protocol


class Clock(Protocol):
    """A source of the current time."""

    def now(self) -> datetime:
        """The current time, timezone-aware, in UTC."""
        ...


class SystemClock:
    """This machine's wall clock."""

    def now(self) -> datetime:
        return datetime.now(timezone.utc)
