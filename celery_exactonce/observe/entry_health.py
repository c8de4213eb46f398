"""Each beat entry's health, for beat's gauges: its last claimed slot, last success, next slot.

Beat's gauge thread (:class:`~celery_exactonce.observe.gauges.StoreGauges`)
calls :meth:`EntryHealthReader.read` when a scrape wants fresh values, never
the tick. One read costs one round trip for every entry's watermark (the last
slot any node claimed) and one ``get`` for each occurrence it has not seen
end yet: an entry's newest claimed slot is read once it changes, and again
on each read until it ends, so the reads follow the occurrences, not the
entries.

An occurrence *succeeded* when its record is ``SUCCEEDED`` (a gated task's
body returned) or ``PUBLISHED`` (an ungated task: the store knows only that
its message left). An entry is *overdue* when the store time is past its last
success's slot (or, with none seen yet, past when this reader first saw the
entry) by more than ``periods + 1`` of its periods: the ``periods`` slots that
followed each had a whole period to succeed, and none did. Only the newest
claimed slot is read: where several slots pass between two reads, an earlier
one's success is not seen, and the entry's last success lags by those slots.

Not here: the metrics (:mod:`celery_exactonce.observe.prometheus`), the thread
(:mod:`celery_exactonce.observe.gauges`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta, tzinfo
from typing import Any

from celery_exactonce.core import exceptions, keys, slots
from celery_exactonce.core.states import State
from celery_exactonce.stores.base import StateStore

#: The states of an occurrence that count as its success.
SUCCESS = frozenset({State.SUCCEEDED, State.PUBLISHED})


@dataclasses.dataclass(frozen=True)
class EntryHealth:
    """One entry as beat's gauges show it (times are fire times, UTC)."""

    entry: str
    task: str
    last_claimed: datetime | None
    """The entry's watermark: the newest slot any node claimed."""
    last_success: datetime | None
    """The newest slot this reader saw succeed (``None``: none seen since beat started)."""
    next_slot: datetime | None
    period: float | None
    """Seconds between the entry's next two slots (``None``: fewer than two left)."""
    overdue: bool


class EntryHealthReader:
    """Reads the health of the entries ``entries()`` gives; remembers what it saw between reads.

    ``entries`` returns beat's schedule as it is now (name -> a beat
    ``ScheduleEntry``); it is called from the gauge thread, so it must copy
    (``dict(scheduler.schedule)``).
    """

    def __init__(
        self,
        store: StateStore,
        entries: Callable[[], Mapping[str, Any]],
        *,
        tz: tzinfo,
        periods: int,
    ) -> None:
        self.store = store
        self.entries = entries
        self.tz = tz
        self.periods = periods
        #: Per entry: the newest slot seen succeed; the claimed slot read last and not
        #: seen ended; the store time this reader first saw the entry.
        self._succeeded: dict[str, datetime] = {}
        self._open: dict[str, datetime] = {}
        self._read: dict[str, datetime] = {}
        self._since: dict[str, datetime] = {}
        #: Per entry: its schedule, next slot and period, kept until that slot passes
        #: (or the schedule is replaced): a read computes slots only for the entries
        #: whose next slot came, not for every entry.
        self._slots: dict[str, tuple[Any, datetime, float | None]] = {}

    def read(self) -> list[EntryHealth]:
        """Every entry's health now (:class:`~celery_exactonce.core.exceptions.StoreError`
        if the store cannot be read: the caller keeps its last values)."""
        schedule = self.entries()
        now = self.store.now()
        marks = self.store.watermarks(list(schedule))
        for name in list(self._since):
            if name not in schedule:  # removed from the schedule: forget it
                for seen in (self._succeeded, self._open, self._read, self._since, self._slots):
                    seen.pop(name, None)
        found = []
        for name, entry in schedule.items():
            self._since.setdefault(name, now)
            mark = marks.get(name)
            if mark is not None and (mark != self._read.get(name) or name in self._open):
                self._look(name, mark)
            found.append(self._health(name, entry, mark, now))
        return found

    def _look(self, name: str, mark: datetime) -> None:
        """Read the occurrence of ``name``'s slot ``mark``: succeeded, ended, or still open."""
        self._read[name] = mark
        self._open.pop(name, None)
        job = self.store.get(keys.occurrence_ref(self.store.namespace, name, mark))
        if job is None:  # not written yet (a claim in flight) or expired: look again next read
            self._open[name] = mark
        elif job.state in SUCCESS:
            if mark > self._succeeded.get(name, mark - timedelta(microseconds=1)):
                self._succeeded[name] = mark
        elif not job.state.terminal:
            self._open[name] = mark

    def _next(
        self, name: str, schedule: Any, now: datetime
    ) -> tuple[datetime | None, float | None]:
        """``name``'s next slot after ``now`` and its period (``None``: none left, or refused)."""
        kept = self._slots.get(name)
        if kept is not None and kept[0] is schedule and kept[1] > now:
            return kept[1], kept[2]
        try:
            upcoming = slots.next_slot(schedule, now, tz=self.tz, entry=name)
            if upcoming is None:
                return None, None
            after = slots.next_slot(schedule, upcoming, tz=self.tz, entry=name)
        except exceptions.ConfigurationError:  # beat refuses it: no slot to show
            return None, None
        period = None if after is None else (after - upcoming).total_seconds()
        self._slots[name] = (schedule, upcoming, period)
        return upcoming, period

    def _health(self, name: str, entry: Any, mark: datetime | None, now: datetime) -> EntryHealth:
        upcoming, period = self._next(name, entry.schedule, now)
        success = self._succeeded.get(name)
        since = success or self._since[name]
        overdue = period is not None and (now - since).total_seconds() > (self.periods + 1) * period
        return EntryHealth(name, str(entry.task), mark, success, upcoming, period, overdue)
