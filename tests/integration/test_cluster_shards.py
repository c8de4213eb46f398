"""A namespace over three shards (``exactonce_shards = 3``) on a real three-master Redis Cluster.

The cluster is started by tests/integration/redis_server.py and killed by pid.
The whole store contract runs there too, opt-in:
``EXACTONCE_TEST_CLUSTER=1 pytest tests/contract -k cluster-shards``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery
from redis.crc import key_slot

from celery_exactonce import ExactOnceConfig, open_store, runtime
from celery_exactonce.core.jobs import CreateStatus
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.dispatch.messages import message_headers
from celery_exactonce.stores.redis.sharded import ShardedRedisStore
from celery_exactonce.stores.shards import shard_bases, shard_of
from celery_exactonce.task.base import ExactOnceTask
from tests.integration.redis_server import cluster
from tests.support.deliveries import deliver_to
from tests.support.helpers import move, occurrence

pytestmark = pytest.mark.timeout(120)


def _app(url: str) -> Celery:
    app = Celery("cluster-shards-test", set_as_current=False)
    app.conf.exactonce_store_url = url
    app.conf.exactonce_namespace = "clustered"  # its 3 shards' slots: 8408, 12537, 154
    app.conf.exactonce_shards = 3
    return app


def _config(url: str) -> ExactOnceConfig:
    return ExactOnceConfig.from_app(_app(url))


def _submitted(job_id: str) -> NewJob:
    return NewJob(JobRef.submitted(job_id), "tasks.t", State.SCHEDULED, node="n", args=[1])


def test_a_namespace_of_three_shards_spreads_over_the_three_masters() -> None:
    with cluster() as group:
        store = open_store(_config(group.url()))
        assert isinstance(store, ShardedRedisStore)
        try:
            # Given jobs and beat occurrences created in one batch each
            now = store.now().replace(microsecond=0)
            news = [_submitted(f"j{i}") for i in range(90)]
            start = now - timedelta(seconds=30)
            slots = [occurrence(f"entry-{i % 6}", start + timedelta(seconds=i)) for i in range(30)]
            assert {r.status for r in store.create_many(news)} == {CreateStatus.CREATED}
            assert {r.status for r in store.create_many(slots)} == {CreateStatus.CREATED}
            assert store.count_by_state()[State.SCHEDULED] == 120
            # Then every master holds keys of the namespace, each key in its shard's slot
            masters = [
                s for s in group.servers if s.client(1.0).info("replication")["role"] == "master"
            ]
            held = {s.port: s.client(1.0).keys("exactonce:{clustered:*") for s in masters}
            print(f"\nkeys of the namespace per master: { {p: len(k) for p, k in held.items()} }")
            assert len(held) == 3 and all(len(keys) > 5 for keys in held.values())
            shard_slots = {key_slot(b.encode()) for b in shard_bases("exactonce:{clustered}", 3)}
            assert {
                key_slot(str(k).encode()) for keys in held.values() for k in keys
            } == shard_slots
            # and an occurrence is on its entry's shard, with the entry's watermark
            job = store.get(slots[0].ref)
            assert job is not None and job.entry == "entry-0"
            home = store._parts[shard_of("entry-0", 3)]
            assert home.get(slots[0].ref) == job
            assert home.watermarks(["entry-0"]) == {"entry-0": start + timedelta(seconds=24)}
        finally:
            store.drop_namespace()
            store.close()


def test_a_shard_that_lost_its_epoch_refuses_only_its_own_claims() -> None:
    with cluster() as group:
        store = open_store(_config(group.url()))
        assert isinstance(store, ShardedRedisStore)
        try:
            held = store.epoch()
            # Given shard 1's epoch gone (its master restarted without persistence)
            lost = store._parts[1]
            lost._client.delete(lost._key("epoch"))
            # When a node still holding the old epoch claims slots of every shard
            fire = store.now().replace(microsecond=0) - timedelta(minutes=1)
            entries = [f"e{i}" for i in range(12)]
            results = store.create_many([occurrence(e, fire) for e in entries], epoch=held)
            # Then the lost shard's claims are refused, the others' made
            for entry, result in zip(entries, results, strict=True):
                refused = shard_of(entry, 3) == 1
                assert (result.status is CreateStatus.EPOCH_MISMATCH) == refused
            assert {shard_of(e, 3) for e in entries} == {0, 1, 2}
            # and the epoch read next is new for shard 1 only, born last (the floor covers it)
            renewed = store.epoch().split(",")
            assert renewed[0::2] == held.split(",")[0::2] and renewed[1] != held.split(",")[1]
        finally:
            store.drop_namespace()
            store.close()


def _noting(store: ShardedRedisStore, calls: list[tuple[str, int]]) -> ShardedRedisStore:
    """``store``, each of its shards' job calls noted in ``calls`` as (call, shard)."""

    def noted(name: str, shard: int, call: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls.append((name, shard))
            return call(*args, **kwargs)

        return wrapper

    for shard, part in enumerate(store._parts):
        for name in ("get", "transition", "transition_many", "heartbeat", "annotate"):
            setattr(part, name, noted(name, shard, getattr(part, name)))
    return store


def test_a_worker_gates_a_beat_occurrence_on_its_entrys_shard_at_the_first_try() -> None:
    with cluster() as group:
        app = _app(group.url())
        beat = open_store(_config(group.url()))
        workers: list[ShardedRedisStore] = []
        runs: list[str] = []

        @app.task(base=ExactOnceTask, shared=False, bind=True, name="t.body")
        def body(self: Any, *args: Any) -> None:
            runs.append(self.request.id)

        def deliver(job_id: str, headers: dict[str, Any], **kw: Any) -> tuple[str, list[Any]]:
            """One delivery on a new worker process's store (it created no job, read none)."""
            calls: list[tuple[str, int]] = []
            worker = open_store(_config(group.url()))
            assert isinstance(worker, ShardedRedisStore)
            workers.append(_noting(worker, calls))
            runtime.install(app, worker)
            return deliver_to(app.tasks["t.body"], job_id, headers, **kw), calls

        try:
            # Given beat's occurrence of an entry on the last shard a search reads
            entry = next(e for i in itertools.count() if shard_of(e := f"nightly-{i}", 3) == 2)
            fire = beat.now().replace(microsecond=0) - timedelta(seconds=5)
            created = beat.create(occurrence(entry, fire, task="t.body"))
            assert created.job is not None
            job = move(beat, created.job, State.DISPATCHED)
            headers = message_headers(job, "clustered")
            # When a worker's gate runs its message: the CAS finds the record at once,
            # the completion too, on the entry's shard, with no read of any shard
            assert deliver(job.ref.id, headers) == ("ran", [("transition_many", 2)] * 2)
            # and a redelivery, to another worker, is refused by the record found at once
            again = deliver(job.ref.id, headers, redelivered=True)
            assert again == ("ignored", [("transition_many", 2)])
            # Then the body ran once, and the job succeeded
            done = beat.get(job.ref)
            assert runs == [job.ref.id] and done is not None and done.state is State.SUCCEEDED
        finally:
            runtime.reset(app)
            beat.drop_namespace()
            for store in (beat, *workers):
                store.close()
