"""The names a django-celery-beat row ran under, so a renamed row runs no slot twice.

A row's name is its entry's key, so a renamed row is a new entry; its pk
outlives the rename. Two rules keep the new name off every slot the row was
claimed for under another name, counted or not yet (a count lags its claim):

* **A rename this node saw.** The node remembers each name it read a row
  under. A row back under a new name starts after its ``last_run_at``, after
  every slot this node decided under the earlier names, and after those
  names' store watermarks, which every claim under them advanced, whichever
  node made it (read in the tick that read the rows: :meth:`RowNames.load`).
* **A floor after each such read.** A claim under an earlier name was made
  by a node that had not read the rename yet, so it planned at a store time
  before this node read the renamed row, and claimed no slot past that time
  plus ``max_skew``. So a renamed row, and a row first read with a history
  (``last_run_at`` or a count) under a name with no store watermark (this
  node started after a rename it never saw), claims no slot at or before
  the store time read after the rows, plus ``max_skew``
  (:meth:`RowNames.hold`); the slots passed over that no watermark shows
  decided are counted as ``unprovable``, as on a new store. A row with no
  history (new, never run) starts at once: there is nothing to continue.

Not here: reading the rows and building their entries
(:mod:`~celery_exactonce.contrib.django_celery_beat`), the watermarks of
entries in general (:class:`~celery_exactonce.beat.scheduler.ExactOnceScheduler`).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from celery_exactonce.contrib import periodic_tasks
from celery_exactonce.stores.base import StateStore


class RowNames:
    """The names this node read each row under, and what a row read anew must not claim.

    ``decided`` is the scheduler's own map of entry name to the newest slot
    it has decided: the rules here only ever raise it.
    """

    def __init__(self, decided: dict[str, datetime], max_skew: float) -> None:
        self._decided = decided
        self._max_skew = timedelta(seconds=max_skew)
        self._names: dict[int, set[str]] = {}  # row pk -> every name this node read it under
        self._earlier: dict[str, set[str]] = {}  # a renamed row's entry -> its earlier names
        self._held: dict[str, bool] = {}  # an entry to hold back -> whether it was renamed

    def read(self, name: str, row: Any) -> None:
        """Row ``row`` was read as entry ``name`` (new to this node, or changed)."""
        if row.last_run_at is not None:
            self.raise_decided(name, periodic_tasks.aware(row.last_run_at))
        names = self._names.setdefault(row.pk, set())
        earlier = names - {name}  # renamed back too: what it ran as since counts as well
        if earlier:
            self._earlier[name] = earlier
            self._held[name] = True
            for old in earlier:  # what this node decided itself, store or no store
                if old in self._decided:
                    self.raise_decided(name, self._decided[old])
        elif not names and (row.last_run_at is not None or row.total_run_count):
            self._held[name] = False
        names.add(name)

    def raise_decided(self, name: str, mark: datetime) -> None:
        if name not in self._decided or self._decided[name] < mark:
            self._decided[name] = mark

    def load(self, store: StateStore) -> None:
        """Raise each renamed entry to its earlier names' store watermarks.

        A store error raises before anything is kept: the tick claims nothing
        (fail closed), and the earlier names are read again next tick.
        """
        if not self._earlier:
            return
        marks = store.watermarks(sorted(set().union(*self._earlier.values())))
        renamed, self._earlier = self._earlier, {}
        for name, earlier in renamed.items():
            for mark in (marks[old] for old in earlier if old in marks):
                self.raise_decided(name, mark)

    def hold(
        self, store: StateStore, skip: Callable[[str, datetime | None, datetime], None]
    ) -> None:
        """Hold back every entry read renamed, or with a history no watermark of its shows.

        Called in the tick that read the rows, after the read: each such entry
        is decided up to the store time now plus ``max_skew``, and
        ``skip(name, decided_before, floor)`` notes the slots passed over. An
        entry first read with a history whose name has a store watermark goes
        on from it: nothing is held back. A store error raises before
        anything is kept (the tick fails closed, and holds them next tick).
        """
        if not self._held:
            return
        marks = store.watermarks(sorted(n for n, renamed in self._held.items() if not renamed))
        floor = store.now() + self._max_skew
        held, self._held = self._held, {}
        for name, renamed in held.items():
            if not renamed and name in marks:
                continue
            before = self._decided.get(name)
            if before is None or before < floor:
                skip(name, before, floor)
                self._decided[name] = floor
