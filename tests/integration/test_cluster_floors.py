"""A shard that lost its data holds back only its own entries, on a real Redis Cluster.

Two beat nodes (two apps in this process, each its own store client and
store-loss guard) tick a namespace of three shards (``exactonce_shards = 3``)
on the three-master cluster of tests/integration/redis_server.py, with two
every-second entries on each shard. Every key of shard 1's hash tag is then
deleted (as a master restarted without persistence would lose them). Opt-in:
``EXACTONCE_TEST_CLUSTER=1 pytest -n 0 tests/integration/test_cluster_floors.py``.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from celery import Celery

from celery_exactonce import ExactOnceConfig, open_store, runtime
from celery_exactonce.beat.scheduler import ExactOnceScheduler
from celery_exactonce.dispatch.dispatcher import Dispatcher
from celery_exactonce.stores.redis.sharded import ShardedRedisStore
from celery_exactonce.stores.shards import shard_of
from tests.integration.redis_server import Cluster, cluster
from tests.support.beat_cluster import Broker, every, isolated, register_plain_tasks

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(
        os.environ.get("EXACTONCE_TEST_CLUSTER") != "1",
        reason="opt-in: EXACTONCE_TEST_CLUSTER=1 (starts a six-server Redis Cluster)",
    ),
]

SHARDS = 3
LOST = 1
MAX_SKEW = 2.0
#: Seconds between the two nodes' ticks (each ticks every other time).
PACE = 0.25


def _entries() -> dict[str, int]:
    """Two entry keys per shard, each with its shard."""
    names: dict[str, int] = {}
    for i in itertools.count():
        shard = shard_of(name := f"floor-{i}", SHARDS)
        if sum(1 for s in names.values() if s == shard) < 2:
            names[name] = shard
        if len(names) == 2 * SHARDS:
            return names
    raise AssertionError("unreachable")


class _InThread(ExactOnceScheduler):
    reconcile_in_thread = False


def _node(url: str, node: str, schedule: dict[str, Any], broker: Broker) -> Celery:
    app = Celery("cluster-floors", set_as_current=False)
    app.conf.update(
        timezone="UTC",
        beat_schedule=schedule,
        exactonce_store_url=url,
        exactonce_namespace="floors",
        exactonce_shards=SHARDS,
        exactonce_max_skew=MAX_SKEW,
        exactonce_window_lookback=60.0,
        exactonce_node_id=node,
        exactonce_reconcile_on="worker",
    )
    register_plain_tasks(app, schedule)
    store = open_store(ExactOnceConfig.from_app(app))
    rt = runtime.install(app, store)
    rt.dispatcher = Dispatcher(store, broker, node=node)
    return app


def _wipe(group: Cluster, base: str) -> int:
    """Delete every key under ``base`` (one hash tag) on the master that holds it."""
    deleted = 0
    for server in group.servers:
        client = server.client(1.0)
        if client.info("replication")["role"] != "master":
            continue
        keys = client.keys(f"{base}*")
        if keys:
            deleted += int(client.delete(*keys))
    return deleted


@pytest.fixture
def _isolated() -> Iterator[None]:
    with isolated():
        yield


def test_a_wiped_shard_skips_only_its_entries_slots(_isolated: None) -> None:
    with cluster() as group:
        entries = _entries()
        schedule = {name: every(1, exactonce={"catchup": "all"}) for name in entries}
        broker = Broker()
        apps = [_node(group.url(), f"node-{n}", schedule, broker) for n in "ab"]
        store = runtime.installed(apps[0]).store  # type: ignore[union-attr]
        assert isinstance(store, ShardedRedisStore)
        beats = [_InThread(app) for app in apps]
        turn = itertools.cycle(beats)
        stop = threading.Event()

        def tick_until(done: Callable[[], bool], timeout: float) -> None:
            deadline = time.monotonic() + timeout
            while not done():
                assert time.monotonic() < deadline, "the beats did not get there in time"
                next(turn).tick()
                stop.wait(PACE)

        def fired(entry: str) -> list[datetime]:
            return sorted(j.fire_time for j in broker.sent if j.entry == entry)  # type: ignore[misc]

        try:
            # Given both nodes claiming every entry's slots
            tick_until(lambda: all(len(fired(e)) >= 3 for e in entries), 30)
            held = store.epoch().split(",")
            # When every key of shard 1's hash tag is deleted
            assert _wipe(group, store._parts[LOST]._base) > 0
            lost_at, wiped = store.now(), len(broker.sent)
            # and the nodes tick on until the lost shard's entries claim again
            floor = lost_at + timedelta(seconds=MAX_SKEW)
            tick_until(
                lambda: all(
                    any(f > floor for f in fired(e)) for e, s in entries.items() if s == LOST
                ),
                30,
            )
            end = store.now() - timedelta(seconds=1)
            tick_until(lambda: all(any(f >= end for f in fired(e)) for e in entries), 15)
            skipped = store.skipped(limit=1000)
        finally:
            stop.set()
            for app in apps:
                runtime.reset(app)
        # Then no slot was dispatched twice
        sent = Counter((j.entry, j.fire_time) for j in broker.sent)
        assert [k for k, n in sent.items() if n > 1] == []
        # and the healthy shards' entries claimed every slot, through the loss
        for entry in (e for e, s in entries.items() if s != LOST):
            run = fired(entry)
            assert run[0] < lost_at and run[-1] >= end
            assert all(b - a == timedelta(seconds=1) for a, b in itertools.pairwise(run)), entry
        # while the lost shard's entries skipped (counted as store_loss) every slot from
        # the loss up to its new floor, and claimed every slot after it
        lost = {e for e, s in entries.items() if s == LOST}
        losses = [r for r in skipped if r.where == "store_loss"]
        assert losses and {r.entry for r in losses} <= lost
        for entry in lost:
            after = [f for f in fired(entry) if f > lost_at]
            assert after and after[0] > lost_at
            assert all(b - a == timedelta(seconds=1) for a, b in itertools.pairwise(after))
            since = [j.fire_time for j in broker.sent[wiped:] if j.entry == entry]
            assert since and all(f > floor for f in since), (entry, since)  # type: ignore[operator]
        # and only the lost shard's epoch changed
        renewed = store.epoch().split(",")
        assert [p == h for p, h in zip(renewed, held, strict=True)] == [True, False, True]
        print(
            f"\nfloors run: {len(broker.sent)} slots dispatched, "
            f"{sum(r.count for r in losses)} skipped as store_loss ({sorted(lost)}), "
            f"lost at {lost_at.isoformat()}"
        )
