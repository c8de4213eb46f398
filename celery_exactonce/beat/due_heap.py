"""The entries of beat keyed by their next slot: what a tick pops, whatever the entry count.

:class:`DueHeap` is a min-heap of ``(next slot, entry name)``. A tick pops the
entries due by the store's time, in slot then name order; it touches only
those (and ``log n`` others), so an idle tick costs the same with 1,000
entries or 100,000. An entry edited at run time is pushed again: its older
item stays in the heap and is dropped when it comes up (lazy deletion), so an
edit costs one push, not a rebuild of every entry's next slot.

Pure: it holds names and times, never an entry, a schedule or the store. What
an entry's next slot is, is :mod:`~celery_exactonce.core.slots`' to say and the
scheduler's to ask.
"""

from __future__ import annotations

import heapq
import itertools
from datetime import datetime


class DueHeap:
    """Entry names by next slot; each name has at most one live item."""

    def __init__(self) -> None:
        self._heap: list[tuple[datetime, str, int]] = []
        self._live: dict[str, int] = {}  # name -> the sequence number of its live item
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, name: object) -> bool:
        return name in self._live

    def push(self, name: str, when: datetime) -> None:
        """Queue ``name`` at ``when``; an item it had before is dropped."""
        seq = next(self._seq)
        self._live[name] = seq
        heapq.heappush(self._heap, (when, name, seq))
        if len(self._heap) > 2 * len(self._live) + 64:  # many edits: drop the dead items
            self._heap = [item for item in self._heap if self._live.get(item[1]) == item[2]]
            heapq.heapify(self._heap)

    def discard(self, name: str) -> None:
        """Forget ``name`` (its item, if any, is dropped when it comes up)."""
        self._live.pop(name, None)

    def clear(self) -> None:
        self._heap.clear()
        self._live.clear()

    def pop_due(self, now: datetime) -> list[tuple[str, datetime]]:
        """The names whose slot is at or before ``now``, each with that slot, in (slot, name)
        order, taken out."""
        due: list[tuple[str, datetime]] = []
        while self._heap and self._heap[0][0] <= now:
            when, name, seq = heapq.heappop(self._heap)
            if self._live.get(name) == seq:
                del self._live[name]
                due.append((name, when))
        return due

    def next_time(self) -> datetime | None:
        """The earliest live slot, or ``None`` when nothing is queued."""
        while self._heap and self._live.get(self._heap[0][1]) != self._heap[0][2]:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None
