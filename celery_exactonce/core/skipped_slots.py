"""What a store keeps of the slots beat skipped: :class:`SkippedSlots`, and its JSON form.

A node that skips slots of an entry in a tick (the reasons are
:mod:`~celery_exactonce.beat.planner`'s) notes each range through
:meth:`StateStore.note_skipped <celery_exactonce.stores.base.StateStore.note_skipped>`,
for the admin and the CLI to read back. Pure values, no I/O: the store sets
the time a range was noted. :class:`SkippedSlots` is importable from
:mod:`celery_exactonce.core.jobs` as well.

Not here: the job record and the store's answers (:mod:`celery_exactonce.core.jobs`);
how beat counts and reports what it skips (:mod:`celery_exactonce.beat.skips`).
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

from celery_exactonce.core import times


@dataclasses.dataclass(frozen=True)
class SkippedSlots:
    """Slots of one beat entry a node skipped in one tick, for one reason, as the store keeps them.

    ``where`` is the reason (``catchup``, ``window``, ``unprovable``,
    ``store_loss``), ``first`` and ``last`` the range, ``count`` the slots in
    it, ``at`` the store time it was noted (set by the store).
    """

    entry: str
    where: str
    first: datetime
    last: datetime
    count: int
    node: str
    at: datetime | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "entry": self.entry,
            "where": self.where,
            "first": times.to_micros(self.first),
            "last": times.to_micros(self.last),
            "count": self.count,
            "node": self.node,
            "at": times.to_micros_opt(self.at),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SkippedSlots:
        return cls(
            entry=str(data["entry"]),
            where=str(data["where"]),
            first=times.from_micros(int(data["first"])),
            last=times.from_micros(int(data["last"])),
            count=int(data["count"]),
            node=str(data["node"]),
            at=times.from_micros_opt(data.get("at")),
        )


def merged(records: list[SkippedSlots]) -> list[SkippedSlots]:
    """``records`` with the same range noted by several nodes as one, its nodes joined.

    Every beat node plans every entry, so a range every node skipped (the
    first moments of a store, a loss all of them met) is noted once per node:
    it is one range of skipped slots, counted once, ``node`` naming each
    node (``a, b``) and ``at`` the newest noting. Order (newest first) kept.
    """
    groups: dict[tuple[str, str, datetime, datetime, int], list[SkippedSlots]] = {}
    for r in records:
        groups.setdefault((r.entry, r.where, r.first, r.last, r.count), []).append(r)
    return [
        dataclasses.replace(
            same[0], node=", ".join(dict.fromkeys(r.node for r in same)), at=same[0].at
        )
        for same in groups.values()
    ]
