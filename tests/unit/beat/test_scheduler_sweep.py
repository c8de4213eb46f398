"""Beat's sweep of delayed jobs: due ``PENDING`` jobs claimed in batches and dispatched.

On the in-memory store and a frozen clock (``beat_cluster``): every node sweeps
after its slots, so these tests count what the whole cluster published.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator, Mapping
from datetime import datetime, timedelta
from typing import Any

import pytest

from celery_exactonce import runtime
from celery_exactonce.beat import sweeper
from celery_exactonce.core import exceptions
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.observe import metrics
from tests.support.beat_cluster import Cluster, isolated

TASK = "plain.t"


@pytest.fixture(autouse=True)
def _isolated() -> Iterator[None]:
    with isolated():
        yield


@pytest.fixture
def small_batches(monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """Sweep batches of 5, at most 3 a tick: the bounds show with a few jobs."""
    monkeypatch.setattr(sweeper, "SWEEP_BATCH", 5)
    monkeypatch.setattr(sweeper, "SWEEP_MAX_BATCHES", 3)
    return 5, 3


def delay(cluster: Cluster, name: str, run_at: datetime) -> JobRef:
    """A delayed job as ``ExactOnceTask.apply_async(eta=run_at)`` stores it."""
    ref = JobRef.submitted(name)
    new = NewJob(ref, TASK, State.PENDING, node="client", args=[name], run_at=run_at)
    assert cluster.store.create(new).created
    return ref


def state(cluster: Cluster, ref: JobRef) -> State:
    job = cluster.store.get(ref)
    assert job is not None
    return job.state


def sent_ids(cluster: Cluster) -> list[str]:
    return [job.ref.id for job in cluster.broker.sent]


def test_due_jobs_are_published_once_across_nodes_in_run_at_order() -> None:
    # Given three nodes and 1,200 delayed jobs that fell due over the last minute
    cluster = Cluster({})
    now = cluster.clock.now()
    refs = [
        delay(cluster, f"job-{i:04}", now - timedelta(seconds=60 - i * 0.05)) for i in range(1200)
    ]
    # When every node ticks, twice
    cluster.tick_all()
    cluster.tick_all()
    # Then each job was published exactly once, oldest run_at first, and is PUBLISHED
    assert sent_ids(cluster) == [ref.id for ref in refs]
    assert {state(cluster, ref) for ref in refs} == {State.PUBLISHED}


def test_a_job_waits_pending_until_its_run_at_on_the_store_clock() -> None:
    # Given a job due in 30 s
    cluster = Cluster({}, nodes=2)
    ref = delay(cluster, "later", cluster.clock.now() + timedelta(seconds=30))
    # When the nodes tick until a microsecond before run_at
    cluster.run(29)
    cluster.clock.advance(1 - 1e-6)
    cluster.tick_all()
    # Then it is still PENDING and unpublished; at run_at it is published once
    assert state(cluster, ref) is State.PENDING and cluster.broker.sent == []
    cluster.clock.advance(1e-6)
    cluster.tick_all()
    assert sent_ids(cluster) == ["later"]


def test_a_sweep_is_bounded_per_tick_and_asks_to_tick_again_at_once(
    small_batches: tuple[int, int],
) -> None:
    batch, batches = small_batches
    # Given one more due job than a tick may sweep
    cluster = Cluster({}, nodes=1)
    now = cluster.clock.now()
    refs = [
        delay(cluster, f"job-{i:02}", now - timedelta(seconds=i))
        for i in range(batch * batches + 1)
    ]
    node = cluster.nodes[0]
    # When the node ticks
    sleep = node.tick()
    # Then it swept exactly its bound, oldest first, and asks for the next tick at once
    assert len(cluster.broker.sent) == batch * batches and sleep == 0.0
    assert [state(cluster, ref) for ref in refs].count(State.PENDING) == 1
    # And the next tick sweeps the rest
    node.tick()
    assert sorted(sent_ids(cluster)) == sorted(ref.id for ref in refs)


def test_sigterm_mid_sweep_dispatches_the_claimed_batch_and_claims_no_more(
    small_batches: tuple[int, int],
) -> None:
    batch, _ = small_batches
    # Given 12 due jobs and a node whose first publish of the sweep receives SIGTERM
    cluster = Cluster({}, nodes=1)
    now = cluster.clock.now()
    refs = [delay(cluster, f"job-{i:02}", now - timedelta(seconds=20 - i)) for i in range(12)]
    node = cluster.nodes[0]
    handler = signal.getsignal(signal.SIGTERM)
    assert callable(handler)
    real_publish = cluster.broker.__call__

    def publish_then_sigterm(
        job: Job, headers: Mapping[str, Any], extra: Mapping[str, Any]
    ) -> None:
        real_publish(job, headers, extra)
        if len(cluster.broker.sent) == 1:
            handler(signal.SIGTERM, None)  # as the signal would, inside the tick

    runtime.runtime_for(cluster.app).dispatcher.publisher = publish_then_sigterm
    # When the tick runs, Then beat exits after it
    with pytest.raises(SystemExit):
        node.tick()
    # Then the whole batch it had claimed was published and nothing else was claimed
    states = [state(cluster, ref) for ref in refs]
    assert states == [State.PUBLISHED] * batch + [State.PENDING] * (12 - batch)
    assert sent_ids(cluster) == [ref.id for ref in refs[:batch]]


def test_a_claim_that_fails_publishes_nothing_and_the_next_tick_sweeps() -> None:
    # Given a due job and a store whose next claim fails
    cluster = Cluster({}, nodes=1)
    ref = delay(cluster, "due", cluster.clock.now() - timedelta(seconds=1))
    real_claim = cluster.store.claim_due
    failures = [exceptions.StoreUnavailable("store down")]

    def claim_due(limit: int, *, node: str, reason: str = "claimed") -> list[Job]:
        if failures:
            raise failures.pop()
        return real_claim(limit, node=node, reason=reason)

    cluster.store.claim_due = claim_due  # type: ignore[method-assign]
    # When the node ticks
    cluster.nodes[0].tick()
    # Then nothing was published, the job is still PENDING, and the failure is counted
    assert cluster.broker.sent == [] and state(cluster, ref) is State.PENDING
    assert metrics.COUNTERS.get("fail_closed", phase="sweep_claim") == 1
    # And the next tick publishes it once
    cluster.clock.advance(1)
    cluster.nodes[0].tick()
    assert sent_ids(cluster) == ["due"]


def test_a_job_due_later_than_the_retention_is_kept_and_runs_at_its_time() -> None:
    # Given a store that keeps terminal records an hour, and a job due in three hours
    cluster = Cluster({}, nodes=1, store_retention=3600)
    run_at = cluster.clock.now() + timedelta(hours=3)
    ref = delay(cluster, "far", run_at)
    # When the nodes tick, and the store purges, all along the three hours
    for _ in range(3 * 6):
        cluster.clock.advance(600)
        cluster.store.purge_expired(1000)
        if cluster.clock.now() < run_at:
            cluster.tick_all()
            assert state(cluster, ref) is State.PENDING
    cluster.tick_all()
    # Then it was never purged and is published once at its time
    assert sent_ids(cluster) == ["far"]
