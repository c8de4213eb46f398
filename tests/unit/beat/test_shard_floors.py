"""The store-loss guard on a sharded store: one floor per shard, moved by that shard's loss only.

An entry's claims and watermark live on its own shard, so a loss on one shard
can have forgotten the claims of that shard's entries only: the others keep
claiming. The sharded store here is on fakeredis (its Lua scripts run there),
on the real clock; the guard's ``max_skew`` is 0 so its floors are the births.
"""

from __future__ import annotations

import itertools
import logging
from datetime import datetime, timedelta, timezone

import fakeredis
import pytest

from celery_exactonce.beat import log as beat_log
from celery_exactonce.beat import planner
from celery_exactonce.beat.entries import EntryPolicy
from celery_exactonce.beat.store_loss import StoreLossGuard
from celery_exactonce.config import ExactOnceConfig
from celery_exactonce.core import exceptions, refs, times
from celery_exactonce.core.jobs import CreateStatus
from celery_exactonce.core.refs import JobRef
from celery_exactonce.stores.redis.sharded import ShardedRedisStore
from celery_exactonce.stores.shards import shard_of
from celery_exactonce.testing import FrozenClock, InMemoryStore
from tests.support.helpers import occurrence

SHARDS = 3
NOW = datetime(2026, 6, 1, 12, 0, 0, tzinfo=timezone.utc)
SKEW = timedelta(seconds=5)


def _on(shard: int, stem: str = "entry") -> str:
    """The first entry key ``<stem>-<i>`` of ``shard``."""
    return next(name for i in itertools.count() if shard_of(name := f"{stem}-{i}", SHARDS) == shard)


def _guard(max_skew: float = 5.0) -> StoreLossGuard:
    return StoreLossGuard(max_skew=max_skew, window_lookback=300.0, shards=SHARDS)


def _epoch(*births: datetime | None) -> str:
    """A joined epoch whose parts are born at ``births`` (``None``: a part with no birth)."""
    return refs.EPOCHS_SEPARATOR.join(
        f"tok{i}" if born is None else f"tok{i}{refs.EPOCH_SEPARATOR}{times.to_micros(born)}"
        for i, born in enumerate(births)
    )


def _store() -> ShardedRedisStore:
    store = ShardedRedisStore(fakeredis.FakeRedis(), namespace="n", retention=3600.0, shards=3)
    store.setup()
    return store


def test_a_reborn_part_moves_only_its_shards_floor() -> None:
    # Given a node holding a namespace's epoch born a day ago on every shard
    g = _guard()
    old = NOW - timedelta(days=1)
    g.adopt(_epoch(old, old, old))
    assert [g.floor_for(_on(s)) for s in range(SHARDS)] == [old + SKEW] * SHARDS
    # When shard 1 is born again now (its master restarted without persistence)
    g.adopt(_epoch(old, NOW, old))
    # Then only shard 1's entries are held back up to its birth plus max_skew
    assert g.floor_for(_on(1)) == NOW + SKEW and not g.provable(NOW + SKEW, _on(1))
    assert g.floor_for(_on(0)) == g.floor_for(_on(2)) == old + SKEW
    assert g.provable(NOW, _on(0)) and g.provable(NOW, _on(2))
    # and what the logs report (the highest floor) is shard 1's
    assert g.floor == NOW + SKEW and not g.provable(NOW + SKEW)


def test_the_planner_skips_only_the_lost_shards_slots() -> None:
    # Given shard 2 reborn a minute ago
    g = _guard()
    old = NOW - timedelta(days=1)
    g.adopt(_epoch(old, old, old))
    g.epoch_refused(_Fixed(_epoch(old, old, NOW - timedelta(seconds=60))), [_on(2)])
    config = ExactOnceConfig(store_url="memory://", window_lookback=300.0, catchup_limit=100)
    policy = EntryPolicy(catchup="all", max_lateness=None, deadline=None)
    decided = NOW - timedelta(seconds=120)

    def plan(entry: str) -> planner.Plan:
        return planner.plan(
            entry,
            timedelta(seconds=10),
            policy,
            tz=timezone.utc,
            config=config,
            decided=decided,
            now=NOW,
            floor=g.floor_for(entry),
            floor_reason=g.reason_for(entry),
        )

    # When the entries of shard 0 and of shard 2 are planned
    healthy, lost = plan(_on(0)), plan(_on(2))
    # Then the healthy shard's entry claims every due slot, the lost one's only those
    # after its shard's new floor (the others skipped as store_loss)
    assert healthy.claim == healthy.due and len(healthy.due) == 12 and not healthy.skipped
    floor = NOW - timedelta(seconds=60) + SKEW
    assert lost.claim == [f for f in lost.due if f > floor]
    assert lost.skipped == [("store_loss", [f for f in lost.due if f <= floor])]
    assert g.reason_for(_on(0)) == "unprovable" and g.reason_for(_on(2)) == "store_loss"


class _Fixed(InMemoryStore):
    """A store whose epoch is ``epoch``, whatever is asked."""

    def __init__(self, epoch: str) -> None:
        super().__init__(clock=FrozenClock(NOW))
        self.fixed = epoch

    def epoch(self, *, replace: str | None = None) -> str:
        return self.fixed


def test_a_wiped_shard_refuses_only_its_claims_and_the_others_keep_claiming() -> None:
    store = _store()
    g = _guard(max_skew=0.0)
    g.adopt(store.epoch())
    held = g.epoch
    floors = [g.floor_for(_on(s)) for s in range(SHARDS)]
    # Given shard 1 wiped (every key of its hash tag), its epoch with it
    lost = store._parts[1]
    lost._client.delete(*lost._client.keys(f"{lost._base}*"))
    # When the node claims a slot of an entry of each shard under the epoch it holds
    fire = store.now()
    news = [occurrence(_on(s), fire) for s in range(SHARDS)]
    results = store.create_many(news, epoch=held)
    statuses = [r.status for r in results]
    assert statuses == [CreateStatus.CREATED, CreateStatus.EPOCH_MISMATCH, CreateStatus.CREATED]
    # and adopts the store's new epoch, as the claimer does on a refusal
    g.epoch_refused(store, [_on(1)])
    # Then only shard 1's floor moved, to its new birth; the other shards' entries
    # keep claiming their slots under the new epoch
    assert g.epoch == store.epoch() != held
    assert [g.floor_for(_on(s)) for s in (0, 2)] == [floors[0], floors[2]]
    new_floor = g.floor_for(_on(1))
    assert new_floor is not None and floors[1] is not None and new_floor > floors[1]
    later = store.now() + timedelta(seconds=1)
    assert g.provable(fire, _on(0)) and g.provable(fire, _on(2)) and not g.provable(fire, _on(1))
    again = store.create_many([occurrence(_on(s), later) for s in range(SHARDS)], epoch=g.epoch)
    assert {r.status for r in again} == {CreateStatus.CREATED}


def test_a_recheck_holds_back_every_shard_and_replaces_every_epoch() -> None:
    # A server that forgot its last writes and kept its epochs (a lagging replica
    # promoted) forgot them on every shard it holds; the few claims re-read show some.
    store = _store()
    a, b = _guard(), _guard()
    a.adopt(store.epoch())
    b.adopt(store.epoch())
    held = store.epoch().split(refs.EPOCHS_SEPARATOR)
    # Given node A's claims of an entry on each shard
    fire = store.now()
    news = [occurrence(_on(s), fire) for s in range(SHARDS)]
    assert {r.status for r in store.create_many(news, epoch=a.epoch)} == {CreateStatus.CREATED}
    for new in news:
        a.claimed(new.ref, fire)
    # When shard 1 forgets A's claim but keeps its epoch
    part = store._parts[1]
    part._client.delete(part._job_key(news[1].ref))
    now = store.now()
    found = a.recheck(store, now)
    # Then A skips every shard's slots up to now + max_skew, and every epoch is new
    assert found is not None and found.missing == [news[1].ref]
    assert found.floor >= now + SKEW
    floors = [a.floor_for(_on(s)) for s in range(SHARDS)]
    assert all(f is not None and now + SKEW <= f <= found.floor for f in floors)
    assert {a.reason_for(_on(s)) for s in range(SHARDS)} == {"store_loss"}
    assert found.message().endswith(f"slots up to {found.floor} are skipped")
    renewed = store.epoch().split(refs.EPOCHS_SEPARATOR)
    assert all(r != h for r, h in zip(renewed, held, strict=True)) and a.epoch == store.epoch()
    # When node B, still holding the old epoch, claims on shard 0
    later = store.now() + timedelta(seconds=1)
    tries = [occurrence(_on(0, "b"), later)]
    statuses = [r.status for r in store.create_many(tries, epoch=b.epoch)]
    assert statuses == [CreateStatus.EPOCH_MISMATCH]
    b.epoch_refused(store, [_on(0, "b")])
    # Then B's floors move on every shard too
    assert b.epoch == store.epoch()
    for s in range(SHARDS):
        b_floor = b.floor_for(_on(s))
        assert b_floor is not None and b_floor >= now + SKEW
    assert {b.reason_for(_on(s)) for s in range(SHARDS)} == {"store_loss"}


def test_a_recheck_on_a_shard_wiped_with_its_epoch_moves_that_shards_floor_alone() -> None:
    # A master restarted without persistence lost its shards' data and epochs alike:
    # the epochs tell which shards, and the recheck takes their word for it.
    store = _store()
    g = _guard()
    g.adopt(store.epoch())
    held = store.epoch().split(refs.EPOCHS_SEPARATOR)
    floors = [g.floor_for(_on(s)) for s in range(SHARDS)]
    fire = store.now()
    news = [occurrence(_on(s), fire) for s in range(SHARDS)]
    assert {r.status for r in store.create_many(news, epoch=g.epoch)} == {CreateStatus.CREATED}
    for new in news:
        g.claimed(new.ref, fire, new.entry)
    # When every key of shard 1 is gone, its epoch with them
    part = store._parts[1]
    part._client.delete(*part._client.keys(f"{part._base}*"))
    now = store.now()
    found = g.recheck(store, now)
    # Then only shard 1's floor moves (to its new epoch's birth + max_skew), nothing is
    # replaced, and the other shards' claims are still re-read
    assert found is not None and found.missing == [news[1].ref] and found.shards == [1]
    assert found.floor == g.floor_for(_on(1)) and found.floor >= now + SKEW
    assert "of the entries on shard(s) 1 up to" in found.message()
    renewed = store.epoch().split(refs.EPOCHS_SEPARATOR)
    assert renewed[0::2] == held[0::2] and renewed[1] != held[1] and g.epoch == store.epoch()
    assert [g.floor_for(_on(s)) for s in (0, 2)] == [floors[0], floors[2]]
    assert g.reason_for(_on(0)) == "unprovable" and g.reason_for(_on(1)) == "store_loss"
    assert g.recheck(store, now) is None
    store._parts[2]._client.delete(store._parts[2]._job_key(news[2].ref))
    again = g.recheck(store, now)  # shard 2 kept its epoch: every shard held back
    assert again is not None and again.shards is None
    assert {g.reason_for(_on(s)) for s in range(SHARDS)} == {"store_loss"}


def test_a_failed_replacement_keeps_the_loss_found() -> None:
    store = _store()
    g = _guard()
    g.adopt(store.epoch())
    held = store.epoch()
    fire = store.now()
    new = occurrence(_on(1), fire)
    assert store.create_many([new], epoch=g.epoch)[0].status is CreateStatus.CREATED
    g.claimed(new.ref, fire)
    store._parts[1]._client.delete(store._parts[1]._job_key(new.ref))
    original = store.epoch
    failing = [True]

    def epoch(*, replace: str | None = None) -> str:  # the first write after a failover
        if replace is not None and failing[0]:
            raise exceptions.StoreUnavailable("READONLY")
        return original(replace=replace)

    store.epoch = epoch  # type: ignore[method-assign]
    now = store.now()
    # When the replacement of the epoch fails
    with pytest.raises(exceptions.StoreUnavailable):
        g.recheck(store, now)
    # Then every shard is held back already, and the loss is found again
    for s in range(SHARDS):
        floor = g.floor_for(_on(s))
        assert floor is not None and floor >= now + SKEW
    failing[0] = False
    found = g.recheck(store, now)
    assert found is not None and store.epoch() != held


def test_an_epoch_not_one_part_per_shard_sets_one_floor_over_every_shard() -> None:
    g = _guard()
    old = NOW - timedelta(days=1)
    g.adopt(_epoch(old, NOW))  # two parts for three shards: another layout's
    assert [g.floor_for(_on(s)) for s in range(SHARDS)] == [NOW + SKEW] * SHARDS


def test_an_epoch_with_a_part_of_no_birth_is_not_split_and_a_loss_holds_back_every_shard() -> None:
    store = InMemoryStore(clock=FrozenClock(NOW))
    g = _guard()
    old = NOW - timedelta(days=1)
    g.adopt(_epoch(old, None, old))  # shard 1's part has no birth: not split
    g.claimed(JobRef.submitted("forgotten"), NOW)  # never written: forgotten
    found = g.recheck(store, NOW)
    assert found is not None
    assert [g.floor_for(_on(s)) for s in range(SHARDS)] == [NOW + SKEW] * SHARDS
    assert {g.reason_for(_on(s)) for s in range(SHARDS)} == {"store_loss"}
    assert found.message().endswith(f"slots up to {NOW + SKEW} are skipped")


def test_a_one_slot_stores_epoch_under_a_sharded_guard_is_one_floor() -> None:
    # An InMemoryStore's epoch is one part: every shard shares its floor, and a
    # recheck replaces it whole, as on one slot.
    store = InMemoryStore(clock=FrozenClock(NOW))
    g = _guard()
    g.adopt(store.epoch())
    held = g.epoch
    g.claimed(JobRef.submitted("gone"), NOW)
    found = g.recheck(store, NOW)
    assert found is not None and store.epoch() == g.epoch != held
    assert {g.floor_for(_on(s)) for s in range(SHARDS)} == {NOW + SKEW}


def test_a_one_slot_guard_reports_a_loss_in_the_words_it_always_did() -> None:
    store = InMemoryStore(clock=FrozenClock(NOW))
    g = StoreLossGuard(max_skew=5.0, window_lookback=300.0)
    g.adopt(store.epoch())
    g.claimed(JobRef.submitted("gone"), NOW)
    found = g.recheck(store, NOW)
    assert found is not None
    assert found.message() == (
        f"1 of this node's recent claims are gone from the store (e.g. t:gone): "
        f"slots up to {NOW + SKEW} are skipped"
    )
    assert g.floor_for("any-entry") == g.floor == NOW + SKEW and g.reason_for("x") == "store_loss"


def test_the_start_message_names_the_shards_a_young_epoch_holds_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = ExactOnceConfig(store_url="memory://", namespace="ns")
    old = NOW - timedelta(days=1)
    messages = []
    for births in ((old, NOW, old), (NOW, NOW, NOW)):
        g = _guard()
        g.adopt(_epoch(*births))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="celery_exactonce"):
            beat_log.started(config, "node-1", g, NOW)
        (guard,) = [r for r in caplog.records if getattr(r, "action", "") == "epoch_guard"]
        messages.append(guard.getMessage())
    # One shard reborn: only its entries are held back, and the message says so
    assert "for the entries of shard(s) 1 only" in messages[0]
    assert (NOW + SKEW).isoformat() in messages[0]
    # A new namespace (every shard young): the one-slot words, unchanged
    assert "shard" not in messages[1] and messages[1].endswith("every slot after it.")
