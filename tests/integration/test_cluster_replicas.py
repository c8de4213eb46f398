"""``exactonce_min_replicas`` on a real Redis Cluster: ``WAIT`` on each slot's master.

Each test starts its own cluster (tests/integration/redis_server.py: three
masters, a replica each unless said otherwise, ``cluster-node-timeout`` 3 s)
and kills it by pid. A replica is paused with SIGSTOP (its acknowledgements
stop, its connection stays up), so that ``WAIT`` times out. The whole store
contract runs on a cluster with ``min_replicas=1`` too, opt-in:
``EXACTONCE_TEST_CLUSTER=1 pytest tests/contract -k replicas``.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from typing import Any

import pytest
from celery import Celery
from redis.crc import key_slot

from celery_exactonce import ConfigurationError, ExactOnceConfig, StoreUnavailable, open_store
from celery_exactonce.beat import claims as beat_claims
from celery_exactonce.core.writes import NewJob
from celery_exactonce.dispatch.dispatcher import Dispatcher
from celery_exactonce.dispatch.outcomes import Outcome
from celery_exactonce.stores.base import StateStore
from celery_exactonce.stores.redis.base import NotReplicated
from celery_exactonce.stores.redis.sharded import ShardedRedisStore
from celery_exactonce.stores.redis.store import RedisStore
from tests.integration.redis_server import Cluster, RedisServer, cluster, wait_for
from tests.integration.test_sentinel import Broker, paused
from tests.support.helpers import occurrence

pytestmark = pytest.mark.timeout(180)

#: The entries a beat claims here: with three shards, each shard is home to some.
ENTRIES = [f"entry-{i}" for i in range(12)]


def _app(url: str, shards: int, **settings: Any) -> Celery:
    app = Celery("cluster-replicas", set_as_current=False)
    app.conf.exactonce_store_url = url
    app.conf.exactonce_namespace = "waiting"
    app.conf.exactonce_store_timeout = 1.0
    app.conf.exactonce_shards = shards
    for name, value in settings.items():
        app.conf[f"exactonce_{name}"] = value
    return app


def _config(url: str, shards: int = 1, min_replicas: int = 1) -> ExactOnceConfig:
    return ExactOnceConfig.from_app(_app(url, shards, min_replicas=min_replicas))


def _parts(store: StateStore) -> list[RedisStore]:
    """The store of each shard (one: the store itself)."""
    if isinstance(store, ShardedRedisStore):
        return store._parts
    assert isinstance(store, RedisStore)
    return [store]


def _master_of(group: Cluster, part: RedisStore) -> RedisServer:
    return group.owner(key_slot(part._key("meta").encode()))


def _claims(entries: list[str], fires: list[datetime]) -> list[NewJob]:
    """One beat's claims of every (entry, fire time): fresh requests (a rev of their own)."""
    return [occurrence(entry, fire) for entry in entries for fire in fires]


@pytest.mark.parametrize("shards", [1, 3])
def test_a_claim_no_replica_acknowledges_is_not_won_and_nothing_is_published(
    shards: int,
) -> None:
    from celery_exactonce.cli.check import run_checks

    with cluster() as group:
        app = _app(group.url(), shards, min_replicas=1)
        store = open_store(ExactOnceConfig.from_app(app))
        try:
            # Given the check's replicas line naming the master of each shard, a replica each
            line = next(c for c in run_checks(app).checks if c.name == "replicas")
            masters = {_master_of(group, part).port for part in _parts(store)}
            assert len(masters) == shards and line.status == "ok", line
            for port in masters:
                assert f"127.0.0.1:{port} has 1" in line.message
            # and claims the replicas acknowledge: won
            now = store.now().replace(microsecond=0)
            epoch = store.epoch()
            confirmed = beat_claims.claim(store, _claims(ENTRIES, [now]), epoch=epoch, now=now)
            assert len(confirmed.won) == len(ENTRIES) and confirmed.error is None
            # When the replica of the master holding the first shard stops acknowledging
            part = _parts(store)[0]
            master = _master_of(group, part)
            entries = [e for e in ENTRIES if _home(store, occurrence(e, now)) == 0][:3]
            job = next(j for n, j in confirmed.won if n.entry in entries)
            fire = now + timedelta(seconds=1)
            broker = Broker()
            with paused(group.replica_of(master)):
                started = time.monotonic()
                # Then a claim there waits its store timeout and raises NotReplicated,
                # naming the master and the setting
                with pytest.raises(NotReplicated) as caught:
                    part.create_many(_claims(entries, [fire]), epoch=epoch.split(",")[0])
                assert time.monotonic() - started >= 0.9
                assert isinstance(caught.value, StoreUnavailable)
                assert f"master 127.0.0.1:{master.port}" in str(caught.value)
                assert "exactonce_min_replicas" in str(caught.value)
                # and beat's claims of that shard are neither won nor taken: undecided
                batch = _claims(entries, [fire + timedelta(seconds=1)])
                claimed = beat_claims.claim(store, batch, epoch=epoch, now=now)
                assert (claimed.won, claimed.taken, claimed.failed) == ([], [], batch)
                assert isinstance(claimed.error, NotReplicated)
                # and a DISPATCHED write no replica confirms publishes nothing
                result = Dispatcher(store, broker, node="n").dispatch(job, retry=False)
                assert result.outcome is Outcome.FAIL_CLOSED
                assert broker.sent == []
            # Once the replica is back, the same dispatch goes through, confirmed
            again = store.get(job.ref)
            assert again is not None
            assert Dispatcher(store, broker, node="n").dispatch(again).outcome is (
                Outcome.PUBLISHED
            )
            assert [j.ref for j in broker.sent] == [job.ref]
        finally:
            store.drop_namespace()  # type: ignore[attr-defined]
            store.close()


def test_start_up_is_refused_when_a_master_has_no_replica() -> None:
    from celery_exactonce import startup
    from celery_exactonce.cli.check import run_checks

    with cluster(masters=3, replicas_per_master=0) as group:
        app = _app(group.url(password=""), 1, min_replicas=1)
        # Given a cluster whose masters have no replica, min_replicas=1 refuses to start
        with pytest.raises(ConfigurationError) as caught:
            startup.check_beat(app)
        assert caught.value.setting == "exactonce_min_replicas"
        assert "0 connected replica(s)" in str(caught.value)
        meta_slot = key_slot(b"exactonce:{waiting}:meta")
        assert f"master 127.0.0.1:{group.owner(meta_slot).port}" in str(caught.value)
        # and `exactonce check` fails its replicas line, naming the setting
        failed = [c for c in run_checks(app).checks if c.status == "FAIL"]
        assert [(c.name, c.setting) for c in failed] == [("replicas", "exactonce_min_replicas")]
        # while min_replicas=0 starts
        open_store(_config(group.url(), min_replicas=0)).close()


def _kept(store: StateStore, batch: list[NewJob]) -> int:
    """How many of ``batch``'s claims the store holds as that claim wrote them."""
    kept = 0
    for new in batch:
        job = store.get(new.ref)
        kept += job is not None and job.rev == new.rev
    return kept


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shards", [1, 3])
def test_every_acknowledged_claim_survives_a_failover_of_its_master(shards: int) -> None:
    with cluster() as group:
        config = _config(group.url(), shards)
        beat_a = open_store(config)
        beat_b: StateStore | None = None
        try:
            now = beat_a.now().replace(microsecond=0)
            fires = [now - timedelta(seconds=s) for s in range(9, -1, -1)]  # oldest first
            # Given beat A's claims, each acknowledged by its master's replica: won
            ours = _claims(ENTRIES, fires)
            epoch = beat_a.epoch()
            won = beat_claims.claim(beat_a, ours, epoch=epoch, now=now).won
            assert len(won) == len(ours)
            # When the master of the last shard's slot is SIGKILLed, and its replica promoted
            last = shards - 1
            part = _parts(beat_a)[last]
            killed = time.monotonic()
            old, new = group.failover_after_kill(key_slot(part._key("meta").encode()))
            promoted = time.monotonic() - killed
            # Then beat A reaches the promoted master (the slot table read again), which
            # has no replica left: A's claims of that shard are refused as unconfirmed
            again = [n for n in _claims(ENTRIES, fires) if _home(beat_a, n) == last]

            def refused_unconfirmed() -> bool:
                try:
                    part.create_many(again, epoch=epoch.split(",")[last])
                except NotReplicated as exc:
                    return f"master 127.0.0.1:{new.port}" in str(exc)
                except StoreUnavailable:
                    return False  # the dead master, until the slot table is read again
                raise AssertionError("a claim counted with no replica to confirm it")

            wait_for("beat A on the promoted master", refused_unconfirmed, timeout=30)
            # and a beat starting now is refused: the promoted master has no replica
            with pytest.raises(ConfigurationError, match=f"master 127.0.0.1:{new.port}"):
                open_store(config)
            # Once the old master is back (as the new one's replica), a second beat starts
            old.start()
            wait_for(
                "the old master replicating", lambda: group.replicas_online(new) >= 1, timeout=60
            )
            beat_b = open_store(config)
            # and its claims of the same slots are all taken: every acknowledged claim is kept
            theirs = _claims(ENTRIES, fires)
            claimed = beat_claims.claim(beat_b, theirs, epoch=beat_b.epoch(), now=now)
            kept = _kept(beat_b, ours)
            print(
                f"\nshards={shards}: claims acknowledged {len(won)}, kept after the failover "
                f"{kept} (replica promoted {promoted:.1f} s after the kill), a second beat's "
                f"claims taken {len(claimed.taken)} of {len(theirs)}"
            )
            assert (len(claimed.won), len(claimed.failed), len(claimed.refused)) == (0, 0, 0)
            assert len(claimed.taken) == len(theirs)
            assert kept == len(won)
        finally:
            for store in (beat_a, beat_b):
                if store is not None:
                    store.close()


def _home(store: StateStore, new: NewJob) -> int:
    """The shard ``new`` is created on."""
    return store._home(new) if isinstance(store, ShardedRedisStore) else 0
