"""DISPATCHED jobs whose message or publish answer was lost: timeouts and opted-in redispatch.

A plain job times out unconfirmed at ``dispatch_timeout`` and is never
republished; a gated one waits for ``dispatch_deadline``. A task that opts in
to redispatch is republished with a doubling back-off (afresh for each
attempt), capped per job and per pass.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from celery_exactonce.core.jobs import Job
from celery_exactonce.core.states import State
from celery_exactonce.observe import metrics
from celery_exactonce.reconcile import reconciler
from tests.support.reconciler_world import (
    DISPATCH_DEADLINE,
    DISPATCH_TIMEOUT,
    PLAIN_REDISPATCH,
    START,
    World,
    retried,
)
from tests.support.reconciling import PLAIN, REDISPATCH, entries


def test_plain_dispatched_times_out_unconfirmed_and_is_never_republished(world: World) -> None:
    # Given plain jobs left DISPATCHED (the publish answer was lost), one whose task
    # even opts in to redispatch
    jobs = [world.put(State.DISPATCHED, PLAIN), world.put(State.DISPATCHED, PLAIN_REDISPATCH)]
    # When passes run for long after dispatch_timeout
    for _ in range(100):
        world.advance(60)
        world.run()
    # Then both ended TIMEOUT (unconfirmed) at dispatch_timeout, and nothing was republished
    for job in jobs:
        after = world.get(job)
        assert after.state is State.TIMEOUT and after.reason == "unconfirmed"
        assert after.terminal_at == START + timedelta(seconds=DISPATCH_TIMEOUT)
    assert world.broker.tries == 0
    assert metrics.COUNTERS.get("timed_out", state="DISPATCHED") == 2


def test_gated_dispatched_times_out_only_after_dispatch_deadline(world: World) -> None:
    # Given a gated job whose message was lost, its task not opted in to redispatch
    job = world.put(State.DISPATCHED)
    # When passes run every minute up to the deadline
    while world.clock.now() < START + timedelta(seconds=DISPATCH_DEADLINE - 60):
        world.advance(60)
        world.run()
        # Then it is left alone (past dispatch_timeout too) and never republished
        assert world.get(job) == job
    world.advance(60)
    world.run()
    after = world.get(job)
    assert after.state is State.TIMEOUT and "dispatch_deadline" in after.reason
    assert after.terminal_at == START + timedelta(seconds=DISPATCH_DEADLINE)
    assert world.broker.tries == 0


def publish_times(world: World, job: Job, *, step: float, until: float) -> list[float]:
    """Run a pass every ``step`` seconds until ``until``; the job's redispatch times (s)."""
    while world.clock.now() < START + timedelta(seconds=until):
        world.advance(step)
        world.run()
    return [
        (h.at - START).total_seconds()
        for h in entries(world.get(job), src=State.DISPATCHED, dst=State.DISPATCHED)
    ]


def test_opted_in_redispatch_backs_off_then_times_out_at_the_deadline(world: World) -> None:
    # Given a gated job of a task that opts in to redispatch, its message lost
    job = world.put(State.DISPATCHED, REDISPATCH)
    # When passes run every 30 s for long
    times = publish_times(world, job, step=30, until=9000)
    # Then it was redispatched with doubling back-off from dispatch_timeout ...
    assert times == [300, 900, 2100, 4500]
    assert world.broker.sent == [(job.ref.id, 0)] * 4
    # ... and, the next back-off (4800 s) being past dispatch_deadline, timed out there
    after = world.get(job)
    assert after.state is State.TIMEOUT
    assert after.terminal_at == START + timedelta(seconds=4500 + DISPATCH_DEADLINE)


def test_redispatch_is_capped_per_job(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reconciler, "MAX_REDISPATCHES", 2)
    job = world.put(State.DISPATCHED, REDISPATCH)
    times = publish_times(world, job, step=30, until=5000)
    # Two redispatches (300, then 600 s later); no third at 900 + 1200 = 2100 s
    assert times == [300, 900] and len(world.broker.sent) == 2
    after = world.get(job)
    assert after.state is State.TIMEOUT
    assert after.terminal_at == START + timedelta(seconds=900 + DISPATCH_DEADLINE)


def test_redispatch_budget_per_pass(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reconciler, "REDISPATCH_BUDGET", 3)
    jobs = []
    for _ in range(7):
        jobs.append(world.put(State.DISPATCHED, REDISPATCH))
        world.advance(1)
    world.advance(DISPATCH_TIMEOUT)
    # When passes run without time passing
    counts = [world.run().redispatched for _ in range(4)]
    # Then each redispatches at most the budget, oldest first, each job once
    assert counts == [3, 3, 1, 0]
    assert [job_id for job_id, _ in world.broker.sent] == [job.ref.id for job in jobs]


def test_redispatch_back_off_starts_afresh_with_each_attempt(world: World) -> None:
    # Given an opted-in job retried 3 times whose 4th attempt's message was lost
    job = retried(world, REDISPATCH, 3)
    world.advance(DISPATCH_TIMEOUT)
    # When a pass runs dispatch_timeout later
    world.run()
    # Then it is redispatched
    assert world.broker.sent == [(job.ref.id, 3)]
