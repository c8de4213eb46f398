"""The Redis store on a real Redis Cluster (three masters, a replica each), namespace in one slot.

Each test starts its own cluster (tests/integration/redis_server.py) and
kills it by pid. The contract suite runs on a cluster too, opt-in:
``EXACTONCE_TEST_CLUSTER=1 pytest tests/contract -k cluster``.
"""

from __future__ import annotations

import pytest
import redis
from celery import Celery

from celery_exactonce import ConfigurationError, ExactOnceConfig, open_store
from celery_exactonce.core.jobs import CreateStatus
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.stores.redis.store import SCRIPT_BATCH, RedisStore
from tests.integration.redis_server import cluster

pytestmark = pytest.mark.timeout(120)


def _config(url: str) -> ExactOnceConfig:
    app = Celery("cluster-test", set_as_current=False)
    app.conf.exactonce_store_url = url
    app.conf.exactonce_namespace = "clustered"
    return ExactOnceConfig.from_app(app)


def _submitted(job_id: str) -> NewJob:
    return NewJob(JobRef.submitted(job_id), "tasks.t", State.SCHEDULED, node="n", args=[1])


def _slot_owner_port(store: RedisStore, key: str) -> int:
    return int(store._node(key).connection_pool.connection_kwargs["port"])


def test_a_namespace_lives_in_one_slot_on_one_master_and_batches_go_there() -> None:
    with cluster() as group:
        store = open_store(_config(group.url(password="")))
        assert isinstance(store, RedisStore)
        try:
            # Given a batch bigger than one script call (two pipelined calls)
            news = [_submitted(f"j{i}") for i in range(SCRIPT_BATCH + 10)]
            assert {r.status for r in store.create_many(news)} == {CreateStatus.CREATED}
            assert {r.status for r in store.create_many(news)} == {CreateStatus.EXISTS}
            assert store.count_by_state()[State.SCHEDULED] == len(news)
            # Then every key of the namespace is on the master of its slot, nowhere else
            owner = _slot_owner_port(store, store._key("meta"))
            pattern = "exactonce:{clustered}:*"
            held = {
                s.port: len(s.client(1.0).keys(pattern))
                for s in group.servers
                if s.client(1.0).info("replication")["role"] == "master"
            }
            assert held.pop(owner) >= len(news)
            assert set(held.values()) == {0}
            # and the pipelines' client is a plain one on that master, not a cluster pipeline
            assert type(store._node(store._key("meta"))) is redis.Redis
            # leases and reads in MULTI work there too
            assert store.acquire_lease("reconcile", "tok", 10)
            holder = store.lease("reconcile")
            assert holder is not None and holder[0] == "tok"
        finally:
            store.drop_namespace()
            store.close()


def test_a_master_that_may_evict_refuses_start_up() -> None:
    with cluster() as group:
        masters = [
            s for s in group.servers if s.client(1.0).info("replication")["role"] == "master"
        ]
        masters[-1].client(1.0).config_set("maxmemory-policy", "allkeys-lru")
        with pytest.raises(ConfigurationError, match="allkeys-lru") as caught:
            open_store(_config(group.url()))
        assert caught.value.setting == "exactonce_store_url"
