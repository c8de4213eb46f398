"""The store-loss guard of a beat node: the epoch it holds, the floor, and its recent claims.

A store can lose data: a Redis restart without persistence, a failover to a
lagging replica. A slot whose claim the store may have forgotten can no
longer be proven unclaimed, so it is skipped and counted, never claimed again:

* every claim carries the epoch this node holds; a mismatch means the store
  lost its data, and the node adopts the store's new epoch;
* epochs carry their birth time on the store clock. No slot at or before
  ``birth + max_skew`` is ever claimed (the *floor*): a claim from before the
  loss had ``store time >= fire_time``, so only those slots can have been
  claimed in the life the store forgot. (A brand-new namespace therefore
  starts claiming ``max_skew`` seconds after its first tick.)
* each node re-reads a few of its own recent claims every tick; one that is
  gone while it should still be kept shows a loss the epoch did not (a lagging
  replica keeps an old epoch), and the node moves its floor to ``store time +
  max_skew`` and replaces the epoch, so the other nodes' next claims are
  refused and their floors move too.

What this leaves open (a store that forgot only its last writes, for about
one tick) is in docs/design/protocol.md, "Store loss".

:class:`StoreLossGuard` reads the store it is given and returns what it found
as values; beat reports them (the scheduler, the claimer). Not here: the claims
themselves (:mod:`~celery_exactonce.claimer`), and which slots are due
(:mod:`~celery_exactonce.planner`).
"""

from __future__ import annotations

import collections
import dataclasses
from datetime import datetime, timedelta

from celery_exactonce import exceptions, refs
from celery_exactonce.refs import JobRef
from celery_exactonce.stores.base import StateStore

#: This node's recent claims kept for the re-check, and how many each tick re-reads.
RECENT_CLAIMS = 1024
RECHECK_PER_TICK = 8


@dataclasses.dataclass(frozen=True)
class Forgotten:
    """Recent claims of this node gone from the store: the floor moved past them."""

    missing: list[JobRef]
    floor: datetime


class StoreLossGuard:
    """What a beat node knows of the store's life (see the module docs).

    ``floor``: no slot at or before it is ever claimed. ``floor_reason`` says
    why slots at or below it are skipped: ``unprovable`` (the store's first
    moments as this node met it: new, or wiped before), ``store_loss`` once a
    loss is detected.
    """

    def __init__(self, *, max_skew: float, window_lookback: float) -> None:
        self._max_skew = timedelta(seconds=max_skew)
        self._lookback = timedelta(seconds=window_lookback)
        self.epoch: str | None = None
        self.floor: datetime | None = None
        self.floor_reason = "unprovable"
        self._recent: collections.deque[tuple[JobRef, datetime]] = collections.deque(
            maxlen=RECENT_CLAIMS
        )

    def adopt(self, epoch: str) -> None:
        """Hold ``epoch``; no slot at or before its birth plus ``max_skew`` is ever claimed."""
        self.epoch = epoch
        born = refs.epoch_born(epoch)
        if born is not None:
            self._raise_floor(born + self._max_skew)

    def provable(self, fire: datetime) -> bool:
        """Whether a claim of the slot at ``fire`` can still be proven first."""
        return self.floor is None or fire > self.floor

    def claimed(self, ref: JobRef, fire: datetime) -> None:
        """Note a claim this node won, for the re-check."""
        self._recent.append((ref, fire))

    def epoch_refused(self, store: StateStore) -> None:
        """Claims were refused for an epoch mismatch: adopt the store's new epoch.

        If it cannot be read, the epoch is dropped: the next tick reads it
        again, and until then nothing is claimed.
        """
        self.floor_reason = "store_loss"
        try:
            self.adopt(store.epoch())
        except exceptions.StoreError:
            self.epoch = None

    def recheck(self, store: StateStore, now: datetime) -> Forgotten | None:
        """Re-read this node's newest claims; what is gone, if any, and the floor moved.

        A :class:`~celery_exactonce.exceptions.StoreError` propagates (the
        tick fails closed).
        """
        horizon = now - self._lookback
        while self._recent and self._recent[0][1] < horizon:
            self._recent.popleft()
        sample = list(self._recent)[-RECHECK_PER_TICK:]
        missing = [ref for ref, _ in sample if store.get(ref) is None]
        if not missing:
            return None
        self.floor_reason = "store_loss"
        self._raise_floor(now + self._max_skew)
        # A store that forgot only its last writes (Redis appendfsync everysec, a lagging
        # replica) kept its epoch: replacing it makes every other node's next claim an
        # epoch mismatch, so they stop short of the forgotten slots too. After a restart
        # without persistence the epoch is gone already, and this takes the new one.
        # The recent claims are dropped only once that worked: if the replacement fails
        # (a failover not over yet), the next recheck finds the loss again.
        self.adopt(store.epoch(replace=self.epoch))
        self._recent.clear()
        assert self.floor is not None  # noqa: S101  (raised just above)
        return Forgotten(missing, self.floor)

    def _raise_floor(self, floor: datetime) -> None:
        if self.floor is None or floor > self.floor:
            self.floor = floor
