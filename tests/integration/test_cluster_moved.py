"""A namespace's slot moved to another master under a running store (first step of SCENARIOS 72).

The slot is moved by hand as ``redis-cli --cluster reshard`` would
(``SETSLOT IMPORTING/MIGRATING``, ``MIGRATE`` of its keys, ``SETSLOT NODE``).
The store's client still routes to the old master: a pipelined batch there
gets ``MOVED`` (it did not run), fails closed, and the next one reaches the
new master; a single script call is redirected by the client. No record is
lost or written twice.
"""

from __future__ import annotations

import pytest
from celery import Celery

from celery_exactonce import ExactOnceConfig, StoreUnavailable, open_store
from celery_exactonce.core.jobs import CreateStatus
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.stores.redis.store import SCRIPT_BATCH, RedisStore
from tests.integration.redis_server import cluster

pytestmark = pytest.mark.timeout(120)


def _submitted(job_id: str) -> NewJob:
    return NewJob(JobRef.submitted(job_id), "tasks.t", State.SCHEDULED, node="n", args=[1])


def test_a_batch_on_a_moved_slot_fails_closed_and_the_next_reaches_the_new_master() -> None:
    with cluster() as group:
        app = Celery("cluster-moved", set_as_current=False)
        app.conf.exactonce_store_url = group.url()
        app.conf.exactonce_namespace = "moving"
        store = open_store(ExactOnceConfig.from_app(app))
        assert isinstance(store, RedisStore)
        try:
            # Given records written on the namespace's master
            first = [_submitted(f"a{i}") for i in range(10)]
            assert {r.status for r in store.create_many(first)} == {CreateStatus.CREATED}
            meta = store._key("meta")
            old_port = int(store._node(meta).connection_pool.connection_kwargs["port"])
            source = next(s for s in group.servers if s.port == old_port)
            target = next(s for s in group.master_servers() if s.port != old_port)
            # When the slot moves to another master, keys and all
            slot = int(source.client(1.0).execute_command("CLUSTER KEYSLOT", meta))
            assert group.move_slot(slot, source, target) >= len(first)
            # Then a pipelined batch (two script calls) sent to the old master fails
            # closed (MOVED: it did not run)
            second = [_submitted(f"b{i}") for i in range(SCRIPT_BATCH + 6)]
            with pytest.raises(StoreUnavailable, match="Moved"):
                store.create_many(second)
            assert not source.client(1.0).keys("exactonce:{moving}:job:*")
            # and the next one, the slot table read again, reaches the new master
            assert {r.status for r in store.create_many(second)} == {CreateStatus.CREATED}
            assert {r.status for r in store.create_many(first)} == {CreateStatus.EXISTS}
            new_port = int(store._node(meta).connection_pool.connection_kwargs["port"])
            assert new_port == target.port
            assert store.count_by_state()[State.SCHEDULED] == len(first) + len(second)
        finally:
            store.drop_namespace()
            store.close()
