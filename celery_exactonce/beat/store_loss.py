"""The store-loss guard of a beat node: the epoch it holds, the floors, and its recent claims.

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

**One floor per shard.** On a sharded store (``exactonce_shards = N``,
:mod:`~celery_exactonce.stores.redis.sharded`) each shard has its own epoch,
and the store's is theirs joined by ``,`` in shard order. An entry's claims
and watermark live on its own shard only (:func:`~celery_exactonce.stores.shards.shard_of`
of its key), so only the entries of a shard that lost data can have
forgotten claims: the guard keeps a floor per shard, each from its own part's
birth, and an entry is held back by its shard's floor alone. That is what an
epoch shows, shard by shard: a shard's epoch lives in its slot, and goes with
its data. A recheck that finds claims gone reads the epochs: if every shard
a claim vanished from has a new epoch part, its data went with its epoch
(a master restarted without persistence) and those shards' floors move
alone. If one kept its epoch, a server forgot its last writes and kept its
epochs (a lagging replica promoted): it forgot them on every shard it
holds, and the few claims re-read show only some of those, so every
shard's floor moves and every shard's epoch is replaced, as on one slot.
An epoch whose parts are not ``N``, or one part of which has no birth, is
not split (fail closed): every shard then shares one floor from the whole
epoch. A one-slot store has one part: one
floor, as ever.

What this leaves open (a store that forgot only its last writes, for about
one tick) is in docs/design/protocol.md, "Store loss".

:class:`StoreLossGuard` reads the store it is given and returns what it found
as values; beat reports them (the scheduler, the claimer). Not here: the claims
themselves (:mod:`~celery_exactonce.beat.claimer`), and which slots are due
(:mod:`~celery_exactonce.beat.planner`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta

from celery_exactonce.core import exceptions, refs
from celery_exactonce.core.refs import EPOCHS_SEPARATOR, JobRef
from celery_exactonce.stores.base import StateStore
from celery_exactonce.stores.shards import shard_of

#: This node's recent claims kept for the re-check, and how many each tick re-reads.
RECENT_CLAIMS = 1024
RECHECK_PER_TICK = 8


@dataclasses.dataclass(frozen=True)
class Forgotten:
    """Recent claims of this node gone from the store: the floor moved past them.

    ``shards``: the shards whose floor moved (their data and epochs gone), or
    ``None`` for every one (one slot, or a loss the epochs do not show).
    """

    missing: list[JobRef]
    floor: datetime
    shards: list[int] | None = None

    def message(self) -> str:
        """What beat says of it (``store_loss_detected``, ``where=recheck``)."""
        scope = "" if self.shards is None else f" of the entries on shard(s) {_listed(self.shards)}"
        return (
            f"{len(self.missing)} of this node's recent claims are gone from the store "
            f"(e.g. {self.missing[0]}): slots{scope} up to {self.floor} are skipped"
        )


class StoreLossGuard:
    """What a beat node knows of the store's life (see the module docs).

    ``shards`` is ``exactonce_shards``. :meth:`floor_for` an entry: no slot of
    it at or before it is ever claimed; :meth:`reason_for` says why slots at or
    below it are skipped: ``unprovable`` (the store's first moments as this node
    met it: new, or wiped before), ``store_loss`` once a loss is detected.
    ``floor`` is the highest shard's floor and ``floor_reason`` is
    ``store_loss`` if any shard's is (on one slot: its floor and reason).
    """

    def __init__(self, *, max_skew: float, window_lookback: float, shards: int = 1) -> None:
        self._max_skew = timedelta(seconds=max_skew)
        self._lookback = timedelta(seconds=window_lookback)
        self._n = shards
        self.epoch: str | None = None
        self._floors: list[datetime | None] = [None] * shards
        self._reasons = ["unprovable"] * shards
        self._births: list[datetime | None] = [None] * shards
        self._split = False  # whether the held epoch's parts are the shards' own
        #: (claim, fire time, its shard or None: unknown)
        self._recent: collections.deque[tuple[JobRef, datetime, int | None]] = collections.deque(
            maxlen=RECENT_CLAIMS
        )

    @property
    def floor(self) -> datetime | None:
        known = [floor for floor in self._floors if floor is not None]
        return max(known) if known else None

    @property
    def floors(self) -> tuple[datetime | None, ...]:
        """Each shard's floor, in shard order (one on a one-slot store)."""
        return tuple(self._floors)

    @property
    def floor_reason(self) -> str:
        return "store_loss" if "store_loss" in self._reasons else "unprovable"

    def floor_for(self, entry: str | None) -> datetime | None:
        """The floor of ``entry``'s shard (``None``: the highest)."""
        return self.floor if entry is None else self._floors[shard_of(entry, self._n)]

    def reason_for(self, entry: str | None) -> str:
        """Why ``entry``'s slots at or below :meth:`floor_for` are skipped."""
        return self.floor_reason if entry is None else self._reasons[shard_of(entry, self._n)]

    def adopt(self, epoch: str) -> None:
        """Hold ``epoch``; no slot at or before its birth plus ``max_skew`` is ever claimed.

        Split (see the module docs), each part's birth raises its shard's
        floor; otherwise the whole epoch's birth raises every shard's.
        """
        self.epoch = epoch
        parts = self._parts(epoch)
        births = [refs.epoch_born(part) for part in parts or ()]
        self._split = parts is not None and None not in births
        if not self._split:
            births = [refs.epoch_born(epoch)] * self._n
        for shard, born in enumerate(births):
            if born is not None:
                self._births[shard] = born
                self._raise(shard, born + self._max_skew)

    def born_for(self, entry: str | None) -> datetime | None:
        """The birth of the epoch ``entry``'s shard holds, while no loss is known there.

        No slot before it can have been claimed in the store's life as this
        node met it, so skipping one loses nothing (``before_store``). Once a
        loss is detected (``store_loss``), ``None``: the slots before the new
        birth are the ones the store may have forgotten.
        """
        if self.reason_for(entry) != "unprovable":
            return None
        if entry is None:
            known = [born for born in self._births if born is not None]
            return min(known) if len(known) == self._n else None
        return self._births[shard_of(entry, self._n)]

    def provable(self, fire: datetime, entry: str | None = None) -> bool:
        """Whether a claim of ``entry``'s slot at ``fire`` can still be proven first."""
        floor = self.floor_for(entry)
        return floor is None or fire > floor

    def claimed(self, ref: JobRef, fire: datetime, entry: str | None = None) -> None:
        """Note a claim this node won, of ``entry`` (its shard's), for the re-check."""
        self._recent.append((ref, fire, None if entry is None else shard_of(entry, self._n)))

    def epoch_refused(self, store: StateStore, entries: Sequence[str] | None = None) -> None:
        """Claims of ``entries`` (``None``: unknown) were refused for an epoch mismatch:
        adopt the store's new epoch; their shards' slots and those of every shard whose
        epoch changed are skipped as ``store_loss``.

        If it cannot be read, the epoch is dropped: the next tick reads it
        again, and until then nothing is claimed.
        """
        held = self.epoch
        self._lost(None if entries is None else {shard_of(e, self._n) for e in entries})
        try:
            epoch = store.epoch()
        except exceptions.StoreError:
            self.epoch = None
            return
        old, new = self._parts(held), self._parts(epoch)
        changed = None if old is None or new is None else _differ(old, new)
        self._lost(changed)
        self.adopt(epoch)

    def recheck(self, store: StateStore, now: datetime) -> Forgotten | None:
        """Re-read this node's newest claims; what is gone, if any, and the floor moved.

        A :class:`~celery_exactonce.core.exceptions.StoreError` propagates (the
        tick fails closed).
        """
        horizon = now - self._lookback
        while self._recent and self._recent[0][1] < horizon:
            self._recent.popleft()
        sample = list(self._recent)[-RECHECK_PER_TICK:]
        gone = [(ref, shard) for ref, _, shard in sample if store.get(ref) is None]
        if not gone:
            return None
        missing = [ref for ref, _ in gone]
        wiped = self._wiped(store, {shard for _, shard in gone})
        if wiped is not None:
            floors = [self._floors[shard] for shard in wiped]
            return Forgotten(missing, max(f for f in floors if f is not None), wiped)
        # Every shard, not only those of the claims found gone: a server that forgot its
        # last writes and kept its epochs forgot them on every shard it holds, and the
        # sample shows some of those only.
        self._lost(None)
        for shard in range(self._n):
            self._raise(shard, now + self._max_skew)
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

    def _wiped(self, store: StateStore, shards: set[int | None]) -> list[int] | None:
        """The shards that lost their data, epochs included, if they explain ``shards``.

        On a split epoch, when every shard a claim was found gone on has a new
        epoch part (its data went with its epoch, as a master restarted without
        persistence loses both), the loss is the epochs' to tell: the new parts
        are adopted, which raises those shards' floors from their births, and
        nothing is replaced. ``None`` otherwise (one slot, an unknown shard, or
        a shard that kept its epoch): the loss is not the epochs' to tell.
        """
        if not self._split or self._n == 1 or None in shards:
            return None
        old, new = self._parts(self.epoch), self._parts(epoch := store.epoch())
        changed = None if old is None or new is None else _differ(old, new)
        if changed is None or not shards <= changed:
            return None
        self._lost(changed)
        self.adopt(epoch)
        kept = [claim for claim in self._recent if claim[2] not in changed]
        self._recent.clear()
        self._recent.extend(kept)
        return sorted(changed)

    def _parts(self, epoch: str | None) -> list[str] | None:
        """``epoch``'s parts, one per shard, or ``None`` if it has not one per shard."""
        if epoch is None:
            return None
        parts = epoch.split(EPOCHS_SEPARATOR) if self._n > 1 else [epoch]
        return parts if len(parts) == self._n else None

    def _each(self, scope: Iterable[int] | None) -> Iterable[int]:
        return range(self._n) if scope is None else scope

    def _lost(self, scope: Iterable[int] | None) -> None:
        for shard in self._each(scope):
            self._reasons[shard] = "store_loss"

    def _raise(self, shard: int, floor: datetime) -> None:
        held = self._floors[shard]
        if held is None or floor > held:
            self._floors[shard] = floor


def _differ(old: list[str], new: list[str]) -> set[int]:
    return {shard for shard, (a, b) in enumerate(zip(old, new, strict=True)) if a != b}


def _listed(shards: list[int]) -> str:
    return ", ".join(str(shard) for shard in shards)
