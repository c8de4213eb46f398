"""Beat's skipped slots: noted per entry at debug, reported once per reason and tick.

Every slot a node skips is counted (``slot_skipped``, the counter grows by
the number of slots), with the reason as the ``where`` label: see
:data:`WHY`. Each entry's own range is a debug record of its own
(``slot_skipped_entry``), and :meth:`SkipTally.records` gives the tick's
ranges as the store keeps them (:meth:`StateStore.note_skipped`, for the
admin). Not here: which slots are skipped (:mod:`~celery_exactonce.planner`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from datetime import datetime

from celery_exactonce import metrics
from celery_exactonce.jobs import SkippedSlots

#: Why slots were skipped, by the ``where`` label of ``slot_skipped``.
WHY = {
    "catchup": "the catch-up policy",
    "window": "they left window_lookback unclaimed",
    "unprovable": "at or before the store epoch's birth + max_skew: a new (or wiped) store",
    "store_loss": "store loss: unprovable",
}


@dataclasses.dataclass(frozen=True)
class SkipReport:
    """Every slot skipped for one reason in a tick: the ``slot_skipped`` event's content."""

    where: str
    total: int
    entries: int
    #: The first entry noted, and its first and last skipped slot.
    entry: str
    first: datetime
    last: datetime

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
        self._skips: dict[str, list[tuple[str, datetime, datetime, int]]] = {}

    def add(self, name: str, fires: list[datetime], where: str) -> None:
        self._skips.setdefault(where, []).append((name, fires[0], fires[-1], len(fires)))

    def reports(self) -> Iterator[SkipReport]:
        """One report per reason, in the order first noted; the tally is empty after."""
        skips, self._skips = self._skips, {}
        for where, noted in skips.items():
            name, first, last, _ = noted[0]
            total = sum(n for *_, n in noted)
            yield SkipReport(where, total, len(noted), name, first, last)

    def note(self, name: str, fires: list[datetime], where: str) -> None:
        """:meth:`add`, and a debug record of the entry's skipped range."""
        metrics.event(
            "slot_skipped_entry",
            f"{name}: {len(fires)} slot(s) from {fires[0].isoformat()} to "
            f"{fires[-1].isoformat()} skipped ({where})",
            level=logging.DEBUG,
            entry=name,
            where=where,
            slots=len(fires),
            first=fires[0].isoformat(),
            last=fires[-1].isoformat(),
        )
        self.add(name, fires, where)

    def records(self, node: str) -> list[SkippedSlots]:
        """The tick's skipped ranges, one per entry and reason, as the store keeps them."""
        return [
            SkippedSlots(name, where, first, last, count, node)
            for where, noted in self._skips.items()
            for name, first, last, count in noted
        ]

    def report(self) -> None:
        """One ``slot_skipped`` event per reason (:meth:`reports`), counting every slot."""
        for report in self.reports():
            metrics.event(
                "slot_skipped",
                report.message,
                labels={"where": report.where},
                count=report.total,
                entry=report.entry,
                entries=report.entries,
                first=report.first.isoformat(),
                last=report.last.isoformat(),
            )
