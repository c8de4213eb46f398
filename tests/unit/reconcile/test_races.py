"""Races: reconcilers in threads against each other, and a worker acting right after a listing.

Every job is acted on once whoever races; a worker's move (the gate, a
returned publish, a heartbeat, a finished body) made between the listing and
the reconciler's write stands.
"""

from __future__ import annotations

import threading

import pytest

from celery_exactonce.core.jobs import Job
from celery_exactonce.core.states import State
from celery_exactonce.reconcile import reconciler
from celery_exactonce.reconcile.reconciler import PassReport
from celery_exactonce.testing import InMemoryStore
from tests.support.reconciler_world import (
    DISPATCH_DEADLINE,
    DISPATCH_TIMEOUT,
    REPLAY_AGE,
    RUNNING_TIMEOUT,
    World,
    after_listing,
)
from tests.support.reconciling import GATED, PLAIN, REDISPATCH, RERUN, HookedStore, gate, move


def test_concurrent_reconcilers_act_once_on_each_job(world: World) -> None:
    # Given many stale jobs of every kind
    kinds = [
        (State.SCHEDULED, GATED),
        (State.SCHEDULED, PLAIN),
        (State.DISPATCHED, PLAIN),
        (State.DISPATCHED, REDISPATCH),
        (State.RUNNING, GATED),
        (State.RUNNING, RERUN),
    ]
    jobs = [world.put(state, task) for state, task in kinds for _ in range(20)]
    world.advance(RUNNING_TIMEOUT)
    # When four reconcilers run passes at once, in threads
    reconcilers = [world.new_reconciler(f"reconciler-{i}") for i in range(4)]
    barrier = threading.Barrier(len(reconcilers))
    reports: list[PassReport] = []

    def run(rec: reconciler.Reconciler) -> None:
        barrier.wait(timeout=10)
        for _ in range(30):
            reports.append(rec.run_pass())

    threads = [threading.Thread(target=run, args=(rec,)) for rec in reconcilers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    # Then every job was acted on exactly once, and published at most once per attempt
    assert sum(r.ran for r in reports) >= 1
    assert all(n == 1 for n in world.broker.count().values())
    assert len(world.broker.sent) == 20 * 4  # replays (2 kinds), redispatches, reruns
    for job in jobs:
        after = world.get(job)
        acted = [
            h
            for h in after.history
            if h.node.startswith("reconciler") and h.reason != "publish returned"
        ]
        assert len(acted) == 1, after.history
    assert sum(r.replayed for r in reports) == 40 and sum(r.timed_out for r in reports) == 40


WORKER_RACES = {
    "gated DISPATCHED at its deadline, the gate runs it": (
        State.DISPATCHED, GATED, DISPATCH_DEADLINE, "gate", State.RUNNING),
    "opted-in DISPATCHED, the gate runs it": (
        State.DISPATCHED, REDISPATCH, DISPATCH_TIMEOUT, "gate", State.RUNNING),
    "plain DISPATCHED, its publish returns": (
        State.DISPATCHED, PLAIN, DISPATCH_TIMEOUT, "published", State.PUBLISHED),
    "RUNNING, a heartbeat lands": (
        State.RUNNING, GATED, RUNNING_TIMEOUT, "heartbeat", State.RUNNING),
    "RUNNING opted-in to rerun, a heartbeat lands": (
        State.RUNNING, RERUN, RUNNING_TIMEOUT, "heartbeat", State.RUNNING),
    "RUNNING, the body finishes": (
        State.RUNNING, GATED, RUNNING_TIMEOUT, "finish", State.SUCCEEDED),
    "SCHEDULED, a landed publish passes the gate": (
        State.SCHEDULED, GATED, REPLAY_AGE, "gate", State.RUNNING),
}  # fmt: skip


def worker_acts(store: InMemoryStore | HookedStore, job: Job, action: str) -> None:
    """What a worker does to ``job`` (as listed) while the reconciler is about to act on it."""
    if action == "gate":
        gate(store, job)  # type: ignore[arg-type]
    elif action == "published":
        move(store, job, State.PUBLISHED, reason="publish returned")  # type: ignore[arg-type]
    elif action == "heartbeat":
        assert store.heartbeat(job.ref, job.run_id or "")
    elif action == "finish":
        move(store, job, State.SUCCEEDED, run_id=job.run_id)  # type: ignore[arg-type]


@pytest.mark.parametrize("race", WORKER_RACES)
def test_a_worker_acting_right_after_the_listing_wins(world: World, race: str) -> None:
    state, task, age, action, then = WORKER_RACES[race]
    # Given a stale job, and a worker that acts on it right after the reconciler listed it
    job = world.put(state, task)
    world.advance(age)
    after_listing(
        world, state, lambda listed: [worker_acts(world.store, j, action) for j in listed]
    )
    # When the pass acts on what it listed
    report = world.run()
    # Then the worker's move stands: no TIMEOUT, no replay, no redispatch, no re-run
    after = world.get(job)
    assert after.state is then and after.attempt == 0
    assert report.timed_out == report.replayed == report.redispatched == report.rerun == 0
    assert world.broker.tries == 0
