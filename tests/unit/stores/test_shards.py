"""``exactonce_shards``: the setting's checks, the pinned shard function, the shards' bases."""

from __future__ import annotations

from typing import Any

import fakeredis
import pytest
from redis.crc import key_slot

from celery_exactonce.config import ExactOnceConfig
from celery_exactonce.core.exceptions import ConfigurationError
from celery_exactonce.core.jobs import CreateStatus
from celery_exactonce.core.refs import JobRef, epoch_born
from celery_exactonce.core.states import State
from celery_exactonce.stores import open_store, store_from_url
from celery_exactonce.stores.redis.keys import key_base
from celery_exactonce.stores.redis.sharded import ShardedRedisStore
from celery_exactonce.stores.redis.store import RedisStore
from celery_exactonce.stores.shards import shard_base, shard_bases, shard_of, slot_range
from tests.support.helpers import occurrence

#: Pinned: changing one moves records to another shard, where they are not looked for.
GOLDEN = [
    ("t:abc", 3, 0),
    ("nightly-report", 3, 1),
    ("o:0123456789abcdef", 12, 7),
    ("", 7, 4),
    ("é", 5, 0),
]


@pytest.mark.parametrize(("text", "shards", "expected"), GOLDEN)
def test_shard_of_is_pinned(text: str, shards: int, expected: int) -> None:
    assert shard_of(text, shards) == expected


def test_one_shard_is_shard_zero_and_keeps_the_one_slot_base() -> None:
    base = key_base("exactonce", "default")
    assert shard_of("anything", 1) == 0
    assert shard_bases(base, 1) == ["exactonce:{default}"]


def test_each_shard_has_its_own_hash_tag_pinned() -> None:
    base = key_base("exactonce", "default")
    # Pinned: another tag is another shard's keys, where the records are not looked for.
    assert shard_bases(base, 3) == [
        "exactonce:{default:0.20}",
        "exactonce:{default:1.18}",
        "exactonce:{default:2}",
    ]
    assert shard_bases(key_base("eo", "payments"), 2) == [
        "eo:{payments:0.4}",
        "eo:{payments:1}",
    ]
    slots = {key_slot(f"{b}:job:t:x".encode()) for b in shard_bases(base, 3)}
    assert len(slots) == 3  # three slots: a script on one shard touches one slot
    with pytest.raises(ValueError):
        shard_base(base, 3, 3)


@pytest.mark.parametrize("shards", [2, 3, 5, 12, 256])
def test_each_shard_hashes_into_the_middle_of_its_part_of_the_slots(shards: int) -> None:
    for namespace in ("default", "bench-shards-1", "x"):
        bases = shard_bases(key_base("exactonce", namespace), shards)
        for s, b in enumerate(bases):
            assert key_slot(f"{b}:due".encode()) in slot_range(s, shards), (namespace, s, b)
    parts = [slot_range(s, 4) for s in range(4)]
    assert [(r.start, r.stop) for r in parts] == [
        (1024, 3072),
        (5120, 7168),
        (9216, 11264),
        (13312, 15360),
    ]


def _master(slot: int, masters: int) -> int:
    """The master of ``slot`` in the split ``redis-cli --cluster create`` makes of ``masters``."""
    per = 16384 / masters  # redis-cli's: first = round(i * per), last = round((i+1) * per) - 1
    return next(i for i in range(masters) if slot <= round((i + 1) * per) - 1)


@pytest.mark.parametrize(("shards", "masters"), [(3, 3), (6, 3), (12, 3), (4, 4), (8, 4), (6, 6)])
def test_a_namespace_spreads_evenly_over_the_masters(shards: int, masters: int) -> None:
    for namespace in ("default", "orders", "bench-shards-3-1"):
        per_master = [0] * masters
        for b in shard_bases(key_base("exactonce", namespace), shards):
            per_master[_master(key_slot(b.encode()), masters)] += 1
        assert per_master == [shards // masters] * masters, (namespace, per_master)


def test_shards_default_to_one_and_below_one_are_refused() -> None:
    assert ExactOnceConfig(store_url="memory://").shards == 1
    for value in (0, -1, 257):
        with pytest.raises(ConfigurationError) as caught:
            ExactOnceConfig(store_url="memory://", shards=value)
        assert caught.value.setting == "exactonce_shards"


@pytest.mark.parametrize("value", [1.5, True, "3"])
def test_shards_must_be_an_integer(value: Any) -> None:
    with pytest.raises(ConfigurationError) as caught:
        ExactOnceConfig(store_url="memory://", shards=value)
    assert caught.value.setting == "exactonce_shards"


@pytest.mark.parametrize("url", ["memory://", "redis://h:6379/0", "sqlite:////tmp/never.db"])
def test_shards_above_one_off_a_cluster_are_refused_at_start_up(url: str) -> None:
    config = ExactOnceConfig(store_url=url, shards=3)
    with pytest.raises(ConfigurationError) as caught:
        open_store(config, setup=False)
    assert caught.value.setting == "exactonce_shards"
    assert "only a Redis Cluster" in str(caught.value)


def test_a_cluster_url_with_shards_builds_a_sharded_store_touching_no_server() -> None:
    config = ExactOnceConfig(store_url="redis+cluster://:secret@h1:7000,h2:7000", shards=3)
    store = open_store(config, setup=False)
    try:
        assert isinstance(store, ShardedRedisStore) and store.shards == 3
        assert "secret" not in repr(store)
        bases = [part._base for part in store._parts]
        assert bases == shard_bases("exactonce:{default}", 3)
    finally:
        store.close()
    # with min_replicas, every shard waits for its master's replicas
    waiting = store_from_url(config.store_url, shards=3, min_replicas=1, socket_timeout=2.0)
    try:
        assert isinstance(waiting, ShardedRedisStore)
        assert [(p._min_replicas, p._wait_ms) for p in waiting._parts] == [(1, 2000)] * 3
        assert waiting._parts[0]._client._options["socket_timeout"] == 4.0
    finally:
        waiting.close()


def _sharded(client: Any, shards: int = 3) -> ShardedRedisStore:
    return ShardedRedisStore(client, namespace="n", retention=3600.0, shards=shards)


def test_the_epoch_is_every_shards_and_born_with_the_newest() -> None:
    client = fakeredis.FakeRedis()
    store = _sharded(client)
    store.setup()
    epoch = store.epoch()
    parts = epoch.split(",")
    assert len(parts) == 3 and [epoch_born(p) for p in parts] and store.epoch() == epoch
    assert epoch_born(epoch) == max(epoch_born(p) for p in parts)
    # one shard forgets its epoch (its master restarted without persistence)
    client.delete(store._parts[1]._key("epoch"))
    renewed = store.epoch()
    assert renewed.split(",")[0::2] == parts[0::2] and renewed.split(",")[1] != parts[1]
    assert epoch_born(renewed) == epoch_born(renewed.split(",")[1])  # the floor covers it


def test_the_shard_count_is_pinned_in_the_namespace() -> None:
    client = fakeredis.FakeRedis()
    _sharded(client, 3).setup()
    for other in (_sharded(client, 2), RedisStore(client, namespace="n", retention=3600.0)):
        with pytest.raises(ConfigurationError) as caught:
            other.setup()
        assert caught.value.setting == "exactonce_shards"
        assert "laid out over 3 shard(s)" in str(caught.value)
    _sharded(client, 3).setup()  # the same count again is fine


def test_a_namespace_holding_one_slot_data_is_not_sharded_in_place() -> None:
    client = fakeredis.FakeRedis()
    RedisStore(client, namespace="n", retention=3600.0).setup()
    with pytest.raises(ConfigurationError) as caught:
        _sharded(client, 3).setup()
    assert "laid out over 1 shard(s)" in str(caught.value)
    RedisStore(client, namespace="n", retention=3600.0).setup()  # still readable as it was
    assert client.hget("exactonce:{n}:meta", "shards") is None  # one shard writes no pin


def test_an_epoch_with_an_empty_part_is_refused_on_that_shard() -> None:
    client = fakeredis.FakeRedis()
    store = _sharded(client)
    store.setup()
    parts = store.epoch().split(",")
    held = ",".join([parts[0], "", parts[2]])  # never checks "no epoch" on shard 1
    news = [occurrence(f"e{i}", store.now()) for i in range(12)]
    assert {shard_of(new.entry or "", 3) for new in news} == {0, 1, 2}
    results = store.create_many(news, epoch=held)
    for new, result in zip(news, results, strict=True):
        refused = result.status is CreateStatus.EPOCH_MISMATCH
        assert refused == (shard_of(new.entry or "", 3) == 1)


def test_the_shards_are_the_partitions_and_what_one_lists_teaches_the_store() -> None:
    client = fakeredis.FakeRedis()
    writer = _sharded(client)
    writer.setup()
    news = [occurrence(f"e{i}", writer.now()) for i in range(6)]
    assert {r.status for r in writer.create_many(news)} == {CreateStatus.CREATED}
    # Another node's store, which never created them, lists each shard on its own
    reader = _sharded(client)
    parts = reader.partitions()
    assert [part._base for part in parts] == shard_bases("exactonce:{n}", 3)
    found = {
        job.ref: shard
        for shard, part in enumerate(parts)
        for job in part.list_stale(State.SCHEDULED, 0, 100)
    }
    assert found == {new.ref: shard_of(new.entry or "", 3) for new in news}
    # and then knows where each lives without reading a record
    assert {ref: reader._locate(ref) for ref in found} == {
        ref: (shard, None) for ref, shard in found.items()
    }


@pytest.mark.parametrize("shards", [1, 3])
def test_a_confirmed_read_and_its_sync_counter_share_the_shards_slot(shards: int) -> None:
    # _confirmed_read sends the read, the counter's INCR and WAIT to the master of the
    # sync key's slot: the record read must be in that slot, whatever its id holds
    client = fakeredis.FakeRedis()
    for shard in range(shards):
        part = RedisStore(client, namespace="n", retention=60.0, shard=shard, shards=shards)
        sync = key_slot(part._key("sync").encode())
        for job_id in ("plain", "{other}", "a}{b", "é"):
            assert key_slot(part._job_key(JobRef.submitted(job_id)).encode()) == sync
