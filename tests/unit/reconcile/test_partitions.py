"""The reconciler on a store of several partitions: a namespace over three shards (fakeredis).

Each pass takes each shard's lease on its own, reconciles the shards it took
and skips those another node holds; a lease lost on one shard stops that
shard only; the report sums the shards; passes start on a shard of the node
and move on by one each pass; ``celery exactonce status`` names each shard's
holder. In real (store) time, with thresholds of a fraction of a second, as
the contract suite (tests/contract/test_reconciler.py runs the two-node case
on every backend, the three-master Redis Cluster included).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import fakeredis
import pytest

from celery_exactonce.cli.inspect import _reconciler
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.observe import metrics
from celery_exactonce.reconcile.passes import lease_token
from celery_exactonce.reconcile.reconciler import LEASE_NAME, Reconciler
from celery_exactonce.stores.redis.sharded import ShardedRedisStore
from celery_exactonce.stores.shards import shard_of
from tests.support.helpers import wait_store_past
from tests.support.reconciling import (
    DISPATCH_TIMEOUT,
    QUICK_SETTINGS,
    REPLAY_AGE,
    Broker,
    HookedStore,
    current,
    make_app,
    put,
    reconciler_on,
)

pytestmark = pytest.mark.timeout(60)

SHARDS = 3
RETENTION = 0.3

#: A gated task whose dispatched jobs wait a minute before anything is done to them: a
#: replayed job is acted on once, however slow the machine.
PATIENT = "rec.patient"
TASKS = {PATIENT: {"exactonce_running_timeout": 60, "exactonce_dispatch_deadline": 60}}


class Namespace:
    """A namespace over three shards on one fakeredis server, and its nodes' reconcilers."""

    def __init__(self) -> None:
        self.server = fakeredis.FakeServer()
        self.store = self.client()
        self.store.setup()
        self.app = make_app(QUICK_SETTINGS, TASKS)
        self.broker = Broker()
        self.shards = self.store.partitions()

    def client(self) -> ShardedRedisStore:
        """The store as another node opens it: a client of its own."""
        client = fakeredis.FakeRedis(server=self.server)
        return ShardedRedisStore(client, namespace="parts", retention=RETENTION, shards=SHARDS)

    def reconciler(self, node: str, store: Any = None) -> Reconciler:
        return reconciler_on(self.app, store or self.client(), self.broker, node=node)

    def put(self, state: State, per_shard: int, wait: float) -> dict[int, list[Job]]:
        """``per_shard`` jobs of :data:`PATIENT` in ``state`` on each shard, ``wait`` s old."""
        ids = (f"{state.value.lower()}-{i}" for i in itertools.count())
        made: dict[int, list[Job]] = {s: [] for s in range(SHARDS)}
        for job_id in ids:
            shard = shard_of(str(JobRef.submitted(job_id)), SHARDS)
            if len(made[shard]) < per_shard:
                made[shard].append(put(self.store, self.app, state, PATIENT, job_id=job_id))
            if all(len(jobs) == per_shard for jobs in made.values()):
                break
        newest = max(job.touched_at for jobs in made.values() for job in jobs)
        wait_store_past(self.store, newest + timedelta(seconds=wait))
        return made

    def holders(self) -> list[str | None]:
        """The token holding each shard's lease (``None``: free)."""
        return [None if (held := s.lease(LEASE_NAME)) is None else held[0] for s in self.shards]

    def state(self, job: Job) -> State:
        return current(self.store, job).state


@pytest.fixture
def ns() -> Iterator[Namespace]:
    namespace = Namespace()
    yield namespace
    namespace.store.close()


def _published(jobs: list[Job]) -> Counter[tuple[str, int]]:
    return Counter((job.ref.id, 0) for job in jobs)


def test_a_pass_skips_the_shard_another_node_holds_and_the_report_adds_up(ns: Namespace) -> None:
    # Given two stale SCHEDULED jobs and one expired terminal record on each shard, and
    # shard 1's lease held by another node
    done = ns.put(State.SUCCEEDED, 1, RETENTION)
    stale = ns.put(State.SCHEDULED, 2, REPLAY_AGE)
    other = lease_token("other-node")
    assert ns.shards[1].acquire_lease(LEASE_NAME, other, 60)
    # When a pass runs
    first = ns.reconciler("node-a").run_pass()
    # Then it reconciled shards 0 and 2, summed, and left shard 1 and its lease alone
    assert (first.ran, first.partitions, first.held_elsewhere) == (True, 2, 1)
    assert (first.replayed, first.expired, first.errors) == (4, 2, 0)
    assert {k: v for k, v in first.stale.items() if v} == {"SCHEDULED": 4}
    assert ns.broker.count() == _published(stale[0] + stale[2])
    assert [ns.state(job) for job in stale[1]] == [State.SCHEDULED] * 2
    assert ns.store.get(done[1][0].ref) is not None
    assert ns.holders() == [None, other, None]
    assert "held_elsewhere=1" in first.summary()
    # When the other node's pass ends, and another pass comes
    assert ns.shards[1].release_lease(LEASE_NAME, other)
    second = ns.reconciler("node-b").run_pass()
    # Then it did shard 1's part, and between them every stale job was replayed once
    assert (second.partitions, second.held_elsewhere, second.replayed, second.expired) == (
        3,
        0,
        2,
        1,
    )
    assert ns.broker.count() == _published([job for jobs in stale.values() for job in jobs])
    assert ns.holders() == [None, None, None]


def test_a_lease_lost_on_one_shard_stops_that_shard_only(ns: Namespace) -> None:
    # Given two stale SCHEDULED jobs on each shard, and a pass whose lease on the first shard
    # it lists expires right then (a long pause) while another node takes it
    stale = ns.put(State.SCHEDULED, 2, REPLAY_AGE)
    hooked = HookedStore(ns.client())
    thief = lease_token("thief")
    stolen: list[int] = []

    def steal(listed: list[Job], state: State, *args: Any, **kwargs: Any) -> list[Job]:
        if State(state) is State.SCHEDULED and listed and not stolen:
            shard = shard_of(str(listed[0].ref), SHARDS)
            part = ns.store._parts[shard]
            part._client.delete(part._key("lease", LEASE_NAME))  # expired
            assert ns.shards[shard].acquire_lease(LEASE_NAME, thief, 60)
            stolen.append(shard)
        return listed

    hooked.after["list_stale"] = steal
    report = ns.reconciler("node-a", hooked).run_pass()
    # Then the writes on that shard were refused and it stopped there; the others went on
    (lost,) = stolen
    assert report.lease_lost and report.partitions == 3 and report.replayed == 4
    assert metrics.COUNTERS.get("reconcile_lease_lost") == 1
    assert [ns.state(job) for job in stale[lost]] == [State.SCHEDULED] * 2
    rest = [job for shard, jobs in stale.items() if shard != lost for job in jobs]
    assert ns.broker.count() == _published(rest)
    assert ns.holders() == [thief if shard == lost else None for shard in range(SHARDS)]


def test_passes_start_on_a_shard_of_the_node_and_move_on_by_one(ns: Namespace) -> None:
    # Given a job on each shard that every pass lists and none acts on yet
    ns.put(State.DISPATCHED, 1, DISPATCH_TIMEOUT)
    hooked = HookedStore(ns.client())
    order: list[int] = []

    def note(listed: list[Job], state: State, *args: Any, **kwargs: Any) -> list[Job]:
        if State(state) is State.DISPATCHED:
            order.extend(shard_of(str(job.ref), SHARDS) for job in listed)
        return listed

    hooked.after["list_stale"] = note
    # When one node runs three passes, and another node one
    node_a = ns.reconciler("node-a", hooked)
    for _ in range(3):
        assert node_a.run_pass().partitions == SHARDS
    assert ns.reconciler("node-b", hooked).run_pass().partitions == SHARDS
    # Then node-a started on its own shard, then on the next; node-b on its own
    a, b = shard_of("node-a", SHARDS), shard_of("node-b", SHARDS)
    assert a != b
    rotations = [[(start + k) % SHARDS for k in range(SHARDS)] for start in (a, a + 1, a + 2, b)]
    assert order == [shard for rotation in rotations for shard in rotation]


def test_status_names_the_holder_of_each_shards_lease(ns: Namespace) -> None:
    assert _reconciler(ns.store, [])["lease_holder"] is None
    assert ns.shards[0].acquire_lease(LEASE_NAME, lease_token("node-a"), 60)
    assert ns.shards[2].acquire_lease(LEASE_NAME, lease_token("node-b"), 60)
    shown = _reconciler(ns.store, [])
    assert shown["lease_holder"] == "node-a, node-b"
    assert [(row["shard"], row["holder"]) for row in shown["leases"]] == [
        (0, "node-a"),
        (1, None),
        (2, "node-b"),
    ]
    expiries = [row["expires"] for row in shown["leases"] if row["expires"] is not None]
    assert len(expiries) == 2 and shown["lease_expires"] == max(expiries)
