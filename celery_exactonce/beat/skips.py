"""Beat's skipped slots: noted per entry at debug, reported once per reason and tick.

Every slot a node skips is counted (``slot_skipped``, the counter grows by
the number of slots), with the reason as the ``where`` label: see
:data:`WHY`. Each entry's own range is a debug record of its own
(``slot_skipped_entry``), and :meth:`SkipTally.records` gives the tick's
ranges as the store keeps them (:meth:`StateStore.note_skipped`, for the
admin). Not here: which slots are skipped (:mod:`~celery_exactonce.beat.planner`).

The report of a tick is an info record, but for ``unprovable``: the slots
of a store's first moments, which beat explains once when it starts
(:mod:`~celery_exactonce.beat.log`), are reported at debug. Slots lost
against the schedule (:data:`TO_SENTRY`: no node claimed them in the
window, or the store lost data) also go to Sentry, tagged with the entry
(``key``) and its task; a catch-up policy's skips are the entry's own choice.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from datetime import datetime

from celery_exactonce.core import exceptions
from celery_exactonce.core.skipped_slots import SkippedSlots
from celery_exactonce.observe import metrics
from celery_exactonce.stores.base import StateStore

#: Why slots were skipped, by the ``where`` label of ``slot_skipped``.
WHY = {
    "catchup": "the catch-up policy",
    "window": "they left window_lookback unclaimed",
    "before_store": "before the store epoch's birth: nothing could be claimed then",
    "unprovable": "at or before the store epoch's birth + max_skew: a new (or wiped) store",
    "store_loss": "store loss: unprovable",
}

#: The reasons whose skipped slots are reported to Sentry too (once per burst).
TO_SENTRY = frozenset({"window", "store_loss"})

#: The reasons reported at debug: the first-start message explains them.
QUIET = frozenset({"unprovable", "before_store"})

#: The reasons counted but not kept in the store: no slot of them was lost, and a
#: record would make a new store look broken to the admin and ``exactonce status``.
NOT_KEPT = frozenset({"before_store"})


@dataclasses.dataclass(frozen=True)
class SkipReport:
    """Every slot skipped for one reason in a tick: the ``slot_skipped`` event's content."""

    where: str
    total: int
    entries: int
    #: The first entry noted, its first and last skipped slot, and its task.
    entry: str
    first: datetime
    last: datetime
    task: str | None = None
    #: Whether every entry noted is of that task.
    one_task: bool = True

    @property
    def message(self) -> str:
        more = f" and {self.entries - 1} more entries" if self.entries > 1 else ""
        return (
            f"{self.total} slot(s) skipped ({WHY[self.where]}): {self.entry} from "
            f"{self.first.isoformat()} to {self.last.isoformat()}{more}"
        )


class SkipTally:
    """The slots skipped in a tick, by reason, until :meth:`reports` drains them."""

    def __init__(self) -> None:
        self._skips: dict[str, list[tuple[str, datetime, datetime, int, str | None]]] = {}

    def add(self, name: str, fires: list[datetime], where: str, task: str | None = None) -> None:
        self._skips.setdefault(where, []).append((name, fires[0], fires[-1], len(fires), task))

    def reports(self) -> Iterator[SkipReport]:
        """One report per reason, in the order first noted; the tally is empty after."""
        skips, self._skips = self._skips, {}
        for where, noted in skips.items():
            name, first, last, _, task = noted[0]
            total = sum(n for _, _, _, n, _ in noted)
            one_task = all(t == task for *_, t in noted)
            yield SkipReport(where, total, len(noted), name, first, last, task, one_task)

    def note(self, name: str, fires: list[datetime], where: str, task: str | None = None) -> None:
        """:meth:`add`, and a debug record of the entry's skipped range."""
        metrics.event(
            "slot_skipped_entry",
            f"{name}: {len(fires)} slot(s) from {fires[0].isoformat()} to "
            f"{fires[-1].isoformat()} skipped ({where})",
            level=logging.DEBUG,
            labels={"where": where, "entry": name, "task": task or ""},
            count=len(fires),
            entry=name,
            where=where,
            slots=len(fires),
            first=fires[0].isoformat(),
            last=fires[-1].isoformat(),
        )
        self.add(name, fires, where, task)

    def records(self, node: str) -> list[SkippedSlots]:
        """The tick's skipped ranges, one per entry and reason, as the store keeps them."""
        return [
            SkippedSlots(name, where, first, last, count, node)
            for where, noted in self._skips.items()
            if where not in NOT_KEPT
            for name, first, last, count, _ in noted
        ]

    def flush(self, store: StateStore, node: str) -> None:
        """Report the tick's skipped slots (:meth:`report`), and keep a record of them in the store.

        The record is for people (the admin); a store error loses it, not a slot.
        """
        records = self.records(node)
        self.report()
        if not records:
            return
        try:
            store.note_skipped(records)
        except exceptions.StoreError as exc:
            metrics.event(
                "skipped_not_recorded",
                f"{len(records)} record(s) of skipped slots not kept in the store ({exc})",
                level=logging.WARNING,
            )

    def report(self) -> None:
        """One ``slot_skipped`` event per reason (:meth:`reports`), counting every slot."""
        for report in self.reports():
            metrics.event(
                "slot_skipped",
                report.message,
                level=_level(report.where),
                # The entry and task fields are the first noted entry's: labels only
                # where every slot counted is of that entry (or of that task).
                labels={
                    "where": report.where,
                    "entry": report.entry if report.entries == 1 else "",
                    "task": (report.task or "") if report.one_task else "",
                },
                sentry=report.where in TO_SENTRY,
                count=report.total,
                key=report.entry,
                task=report.task,
                entry=report.entry,
                entries=report.entries,
                first=report.first.isoformat(),
                last=report.last.isoformat(),
            )


def _level(where: str) -> int:
    """Slots lost against the schedule warn; the first moments of a store are explained once."""
    if where in TO_SENTRY:
        return logging.WARNING
    return logging.DEBUG if where in QUIET else logging.INFO
