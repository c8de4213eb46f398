"""No starvation: failing jobs and long backlogs never hold off the other jobs' rules.

Jobs whose every write fails are counted, backed off and skipped; a backlog of
gated jobs waiting in a busy queue, even longer than one pass lists, delays a
plain job's timeout by one pass at most, and the listing comes back to its head.
"""

from __future__ import annotations

from celery_exactonce.core.states import State
from celery_exactonce.reconcile import reconciler
from tests.support.reconciler_world import (
    DISPATCH_TIMEOUT,
    REPLAY_AGE,
    RUNNING_TIMEOUT,
    SLOW_PLAIN,
    World,
    fail_writes_of,
)
from tests.support.reconciling import GATED, PLAIN, RERUN


def test_a_hundred_failing_jobs_at_the_head_do_not_starve_the_rest(world: World) -> None:
    # Given 100 stale SCHEDULED jobs whose every write fails, oldest of all
    poison = [world.put(State.SCHEDULED) for _ in range(100)]
    world.advance(1)
    others = [
        world.put(state, task)
        for state, task in [
            (State.SCHEDULED, GATED),
            (State.SCHEDULED, PLAIN),
            (State.DISPATCHED, PLAIN),
            (State.RUNNING, GATED),
            (State.RUNNING, RERUN),
        ]
        for _ in range(4)
    ]
    fail_writes_of(world, {job.ref for job in poison})
    world.advance(RUNNING_TIMEOUT)
    # When a pass runs
    first = world.run()
    # Then every other job was handled in that same pass; the failures are counted
    assert all(world.get(job) != job for job in others)
    assert (first.replayed, first.timed_out, first.rerun) == (8, 8, 4)
    assert first.errors == 100 and all(world.get(job) == job for job in poison)
    # and the next pass skips the failing jobs while they back off
    world.advance(1)
    second = world.run()
    assert second.skipped == 100 and second.errors == 0


def test_failing_jobs_do_not_hold_off_the_timeouts_of_others(world: World) -> None:
    # Given stale jobs whose writes always fail
    poison = [world.put(State.SCHEDULED) for _ in range(10)]
    fail_writes_of(world, {job.ref for job in poison})
    world.advance(REPLAY_AGE)
    world.run()
    # When a running job's worker dies later, and passes run every minute for an hour
    dead = world.put(State.RUNNING)
    for _ in range(60):
        world.advance(60)
        world.run()
    # Then it was timed out, about running_timeout after its last heartbeat
    assert world.state(dead) is State.TIMEOUT


def test_a_backlog_of_waiting_gated_jobs_does_not_starve_plain_timeouts(world: World) -> None:
    # Given 1000 gated jobs waiting in a busy queue for over dispatch_timeout
    for _ in range(reconciler.LIST_LIMIT):
        world.put(State.DISPATCHED)
    world.advance(100)
    # and a plain job whose publish answer was lost
    plain = world.put(State.DISPATCHED, PLAIN)
    world.advance(DISPATCH_TIMEOUT)
    # When passes run for a few minutes (far short of the gated jobs' deadline)
    for _ in range(10):
        world.run()
        world.advance(10)
    # Then the plain job was timed out
    assert world.state(plain) is State.TIMEOUT


def test_a_backlog_longer_than_a_pass_reads_delays_a_plain_timeout_by_one_pass(
    world: World,
) -> None:
    # Given more gated jobs waiting in a busy queue than one pass lists (LIST_PAGES pages)
    backlog = reconciler.LIST_PAGES * reconciler.LIST_LIMIT + reconciler.LIST_LIMIT // 2
    for _ in range(backlog):
        world.put(State.DISPATCHED)
    world.advance(100)
    # and a plain job whose publish answer was lost, behind them all
    plain = world.put(State.DISPATCHED, PLAIN)
    world.advance(DISPATCH_TIMEOUT)
    # When a pass runs
    first = world.run()
    # Then it listed its LIST_PAGES pages of the backlog, no more, and the plain job waits
    assert first.stale["DISPATCHED"] == reconciler.LIST_PAGES * reconciler.LIST_LIMIT
    assert world.state(plain) is State.DISPATCHED
    # When the next pass runs
    world.advance(10)
    second = world.run()
    # Then it went on from where the first stopped and timed the plain job out
    assert second.stale["DISPATCHED"] == backlog + 1 - first.stale["DISPATCHED"]
    assert world.state(plain) is State.TIMEOUT
    # and the pass after that starts over from the oldest job
    world.advance(10)
    assert world.run().stale["DISPATCHED"] == reconciler.LIST_PAGES * reconciler.LIST_LIMIT


def test_a_job_at_the_head_is_looked_at_again_once_the_listing_starts_over(
    world: World,
) -> None:
    # Given a plain job with a long dispatch_timeout, the oldest of all
    slow = world.put(State.DISPATCHED, SLOW_PLAIN)
    world.advance(1)
    # and behind it more gated jobs waiting in a busy queue than one pass lists
    for _ in range(reconciler.LIST_PAGES * reconciler.LIST_LIMIT):
        world.put(State.DISPATCHED)
    world.advance(DISPATCH_TIMEOUT)
    # When passes run, the slow job's timeout passing meanwhile
    world.run()
    world.advance(900 - DISPATCH_TIMEOUT)
    reports = [world.run() for _ in range(2)]
    # Then the listing came back to the head within those passes and timed it out
    assert world.state(slow) is State.TIMEOUT
    assert sum(report.timed_out for report in reports) == 1
