"""The plan of a tick for one entry: which due slots to claim, which to skip, and why.

Pure: it reads a schedule, the entry's policy and what this node knows (how
far it has decided the entry's slots, the store-loss floor) and returns a
:class:`Plan`. It neither reads the store nor calls back into the scheduler.

* slots in ``(last decided, store time]`` and within ``window_lookback`` are
  due. Due-ness is judged on the store's clock, never this node's, so a node
  never claims a slot before ``store time >= fire_time``;
* slots that left the window unclaimed while this node held the entry are
  skipped (``window``);
* slots at or before the store-loss floor of the entry (its shard's, on a
  sharded store) are skipped (``unprovable`` or ``store_loss``,
  :mod:`~celery_exactonce.beat.store_loss`); those before the birth of a store
  that lost nothing are ``before_store``, which no record keeps;
* after downtime, the entry's catch-up policy picks which missed slots to
  claim (``latest`` by default, the newest ``catchup_limit`` with ``all``,
  ``none``); ``max_lateness`` skips slots that are too late (``catchup``).

Every skipped slot is counted, once per tick and reason (:mod:`~celery_exactonce.beat.skips`).

Not here: the claims (:mod:`~celery_exactonce.beat.claimer`), the job of a slot
(:mod:`~celery_exactonce.beat.entries`).
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta, tzinfo
from typing import Any

from celery_exactonce.beat.entries import EntryPolicy
from celery_exactonce.config import ExactOnceConfig
from celery_exactonce.core import slots
from celery_exactonce.core.writes import NewJob


@dataclasses.dataclass
class Plan:
    """One entry's work in a tick: its due slots, those to claim, and how far it is decided.

    ``start`` is where the entry stood before the tick (moved up to the window
    if it had fallen out of it). Every due slot is decided (claimed, found
    claimed, or skipped and counted) except those whose claim failed on a store
    error: the entry is decided up to the last slot before the first failure, so
    the next tick tries that one again (fail closed) and nothing decided is
    counted twice.
    """

    name: str
    start: datetime
    due: list[datetime] = dataclasses.field(default_factory=list)
    #: Fire times to claim, and the jobs the scheduler builds for them.
    claim: list[datetime] = dataclasses.field(default_factory=list)
    claims: list[NewJob] = dataclasses.field(default_factory=list)
    #: ``(where, fire times)`` skipped by the plan (see :data:`~celery_exactonce.beat.skips.WHY`).
    skipped: list[tuple[str, list[datetime]]] = dataclasses.field(default_factory=list)
    failed: list[datetime] = dataclasses.field(default_factory=list)
    #: Fire times the claims found claimed: won by this node, or by another before it.
    claimed: list[datetime] = dataclasses.field(default_factory=list)
    #: Those of :attr:`claimed` this node won.
    won: list[datetime] = dataclasses.field(default_factory=list)

    def decided_to(self) -> datetime:
        if not self.due:
            return self.start
        if not self.failed:
            return self.due[-1]
        first = min(self.failed)
        return max([self.start, *(f for f in self.due if f < first)])


def plan(
    name: str,
    schedule: Any,
    policy: EntryPolicy,
    *,
    tz: tzinfo,
    config: ExactOnceConfig,
    decided: datetime | None,
    now: datetime,
    floor: datetime | None,
    floor_reason: str,
    born: datetime | None = None,
) -> Plan:
    """The plan of ``name`` at store time ``now``, its slots decided up to ``decided``.

    No slot at or before ``floor`` is claimed (skipped as ``floor_reason``);
    of those, the slots before ``born`` (the store epoch's birth, on a store
    that lost nothing) are skipped as ``before_store``: none could be claimed.
    """
    lookback = now - timedelta(seconds=config.window_lookback)
    result = Plan(name, start=lookback if decided is None else decided)
    if decided is not None and decided < lookback:
        fallen = slots.slots_between(schedule, decided, lookback, tz=tz, entry=name)
        if fallen:  # a lower bound when there were more than slots.DEFAULT_LIMIT
            result.skipped.append(("window", fallen))
        result.start = lookback
    due = slots.slots_between(schedule, result.start, now, tz=tz, entry=name)
    if not due:
        return result
    if len(due) == slots.DEFAULT_LIMIT:  # truncated: the latest slot is further on
        latest = slots.latest_slot(schedule, now, tz=tz, entry=name)
        if latest is not None and latest > due[-1]:
            due.append(latest)
    result.due = due
    unprovable = [f for f in due if floor is not None and f <= floor]
    before = [f for f in unprovable if born is not None and f < born]
    if before:
        result.skipped.append(("before_store", before))
    if unprovable[len(before) :]:
        result.skipped.append((floor_reason, unprovable[len(before) :]))
    provable = due[len(unprovable) :]
    if provable:
        result.claim, late = select(policy, provable, now, config)
        if late:
            result.skipped.append(("catchup", late))
    return result


def select(
    policy: EntryPolicy, due: list[datetime], now: datetime, config: ExactOnceConfig
) -> tuple[list[datetime], list[datetime]]:
    """The slots of ``due`` to claim under the entry's catch-up policy, and those it skips."""
    # "none": only what fell due since the previous tick; nothing missed is caught up.
    on_time = now - timedelta(seconds=config.tick_interval)
    if policy.max_lateness is not None:
        too_late = [f for f in due if (now - f).total_seconds() > policy.max_lateness]
        due = [f for f in due if f not in too_late]
    else:
        too_late = []
    if policy.catchup == "all":  # the newest ones, as "latest" is the newest one
        keep = len(due) - config.catchup_limit
        return due[max(0, keep) :], too_late + due[: max(0, keep)]
    if policy.catchup == "none":
        claim = [f for f in due if f >= on_time]
        return claim, too_late + [f for f in due if f < on_time]
    return due[-1:], too_late + due[:-1]
