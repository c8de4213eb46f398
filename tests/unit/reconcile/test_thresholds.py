"""When each of the reconciler's rules acts: never on a fresh job, and exactly at its threshold.

A microsecond before and at every threshold (replay age, dispatch timeout and
deadline, running timeout), the per-task attributes that override the settings
(read from the app's registry by default), ages measured on the store's clock
rather than this host's, and the purge of terminal records at the retention.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import pytest

from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.reconcile import reconciler
from tests.support.reconciler_world import (
    DISPATCH_DEADLINE,
    DISPATCH_TIMEOUT,
    MICROSECOND,
    QUICK,
    QUICK_PLAIN,
    REPLAY_AGE,
    RUNNING_TIMEOUT,
    SLOW,
    SLOW_PLAIN,
    START,
    World,
)
from tests.support.reconciling import GATED, NODE, PLAIN, REDISPATCH, RERUN


def test_fresh_jobs_are_left_alone(world: World) -> None:
    # Given a job of every kind in every live state, just under the youngest threshold
    jobs = [
        world.put(state, task)
        for state in (State.SCHEDULED, State.DISPATCHED, State.RUNNING)
        for task in (GATED, PLAIN, REDISPATCH, RERUN, QUICK, QUICK_PLAIN)
        if not (state is State.RUNNING and task in (PLAIN, QUICK_PLAIN))
    ]
    pending = world.store.create(
        NewJob(
            JobRef.submitted("later"),
            GATED,
            State.PENDING,
            node=NODE,
            run_at=START - timedelta(days=30),
        )
    ).job
    assert pending is not None
    world.advance(REPLAY_AGE - MICROSECOND)
    # When passes run
    reports = [world.run() for _ in range(3)]
    # Then nothing changed, nothing was published; PENDING (the sweeper's) is never touched
    assert [world.get(job) for job in jobs] == jobs
    assert world.get(pending) == pending
    assert world.broker.tries == 0
    assert all(
        r.replayed == r.timed_out == r.redispatched == r.rerun == r.errors == 0 for r in reports
    )


@pytest.mark.parametrize(
    ("state", "task", "threshold", "then"),
    [
        (State.SCHEDULED, GATED, REPLAY_AGE, State.DISPATCHED),
        (State.SCHEDULED, PLAIN, REPLAY_AGE, State.PUBLISHED),
        (State.DISPATCHED, PLAIN, DISPATCH_TIMEOUT, State.TIMEOUT),
        (State.DISPATCHED, GATED, DISPATCH_DEADLINE, State.TIMEOUT),
        (State.DISPATCHED, REDISPATCH, DISPATCH_TIMEOUT, State.DISPATCHED),
        (State.RUNNING, GATED, RUNNING_TIMEOUT, State.TIMEOUT),
        (State.RUNNING, RERUN, RUNNING_TIMEOUT, State.DISPATCHED),
        (State.DISPATCHED, QUICK_PLAIN, 120, State.TIMEOUT),
        (State.RUNNING, QUICK, 120, State.TIMEOUT),
    ],
)
def test_each_rule_acts_at_its_threshold_not_a_microsecond_before(
    world: World, state: State, task: str, threshold: float, then: State
) -> None:
    # Given a job that a microsecond from now has been in its state for the threshold
    job = world.put(state, task)
    world.advance(threshold - MICROSECOND)
    # When a pass runs now, nothing happens
    world.run()
    assert world.get(job) == job and world.broker.tries == 0
    # Then a microsecond later it acts, once
    world.advance(MICROSECOND)
    world.run()
    after = world.get(job)
    assert after.state is then and after.rev != job.rev
    assert after.touched_at == START + timedelta(seconds=threshold)
    published = 1 if then in (State.DISPATCHED, State.PUBLISHED) else 0
    assert len(world.broker.sent) == published
    world.run()
    assert world.get(job) == after and len(world.broker.sent) == published


def test_task_attributes_override_the_settings(world: World) -> None:
    # Given jobs of tasks with their own limits (and of tasks without), all at START
    cases = {
        (State.RUNNING, QUICK): 120,
        (State.DISPATCHED, QUICK_PLAIN): 120,
        (State.DISPATCHED, PLAIN): DISPATCH_TIMEOUT,
        (State.RUNNING, GATED): RUNNING_TIMEOUT,
        (State.DISPATCHED, QUICK): 900,
        (State.DISPATCHED, SLOW_PLAIN): 900,
        (State.RUNNING, SLOW): 1200,
        (State.DISPATCHED, GATED): DISPATCH_DEADLINE,
        (State.DISPATCHED, SLOW): 7200,
    }
    jobs = {case: world.put(*case) for case in cases}
    # When passes run every 10 s
    while world.clock.now() < START + timedelta(seconds=7300):
        world.advance(10)
        world.run()
    # Then each timed out after its own limit
    ages = {
        case: (world.get(job).terminal_at - START).total_seconds()  # type: ignore[operator]
        for case, job in jobs.items()
    }
    assert ages == cases
    assert all(world.state(job) is State.TIMEOUT for job in jobs.values())


def test_the_default_reconciler_reads_task_attributes_from_the_apps_registry(
    world: World,
) -> None:
    # The reconciler beat and the worker task run: built without an explicit registry
    job = world.put(State.DISPATCHED, QUICK_PLAIN)
    world.advance(120)
    report = reconciler.Reconciler(world.reconciler.runtime).run_pass()
    assert report.ran and report.timed_out == 1 and world.state(job) is State.TIMEOUT


def test_ages_are_measured_on_the_store_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a store whose clock is 11 minutes behind this host's (the reconciler's clock
    # is 11 minutes fast: past every threshold but the gated deadline)
    world = World(start=datetime.now(timezone.utc) - timedelta(minutes=11))
    jobs = [
        world.put(State.SCHEDULED),
        world.put(State.DISPATCHED, PLAIN),
        world.put(State.RUNNING),
        world.put(State.DISPATCHED, REDISPATCH),
    ]
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 11 * 60)
    world.mono.advance(11 * 60)
    # When passes run while the store's clock stands still
    for _ in range(5):
        world.run()
        world.mono.advance(60)
    # Then no job aged: nothing was replayed, timed out or republished
    assert [world.get(job) for job in jobs] == jobs and world.broker.tries == 0
    # and once the store's clock moves on, they do
    world.clock.advance(RUNNING_TIMEOUT)
    report = world.run()
    assert (report.replayed, report.timed_out, report.redispatched) == (1, 2, 1)


def test_terminal_records_past_retention_are_purged_live_ones_never() -> None:
    world = World(retention=1000)
    # Given terminal jobs of every kind, and a delayed job due in a year
    done = [
        world.put(state)
        for state in (State.SUCCEEDED, State.FAILED, State.CANCELLED, State.TIMEOUT)
    ]
    done.append(world.put(State.PUBLISHED, PLAIN))
    pending = world.store.create(
        NewJob(
            JobRef.submitted("next-year"),
            GATED,
            State.PENDING,
            node=NODE,
            run_at=START + timedelta(days=365),
        )
    ).job
    assert pending is not None
    world.advance(1000 - MICROSECOND)
    assert world.run().expired == 0
    world.advance(MICROSECOND)
    # When a pass runs at the retention
    report = world.run()
    # Then the terminal records are gone, the live one is untouched
    assert report.expired == len(done)
    assert all(world.store.get(job.ref) is None for job in done)
    assert world.get(pending) == pending
