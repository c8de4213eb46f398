"""The lease a pass runs under, and the passes a beat node runs itself.

A pass while another token holds the lease does nothing; an expired lease
does not block; the lease is released after every pass (store errors and bugs
included); a reconciler that lost its lease mid-pass stops and acts on nothing
more. A pass end the store refused is recorded before the next pass.
"""

from __future__ import annotations

from typing import Any

import pytest

from celery_exactonce.core import exceptions
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import Transition
from celery_exactonce.observe import metrics
from celery_exactonce.reconcile import task as reconcile_task
from celery_exactonce.reconcile.reconciler import LEASE_NAME, PassReport
from tests.support.reconciler_world import (
    LEASE_TTL,
    REPLAY_AGE,
    RUNNING_TIMEOUT,
    World,
    after_listing,
    fail_writes_of,
)
from tests.support.reconciling import PLAIN, REDISPATCH, RERUN


def test_a_pass_while_another_token_holds_the_lease_does_nothing(world: World) -> None:
    jobs = [
        world.put(State.SCHEDULED),
        world.put(State.DISPATCHED, PLAIN),
        world.put(State.RUNNING),
    ]
    assert world.store.acquire_lease(LEASE_NAME, "someone-else", 10 * RUNNING_TIMEOUT)
    world.advance(RUNNING_TIMEOUT)
    report = world.reconciler.run_pass()
    assert report.ran is False and report.errors == 0
    assert (report.partitions, report.held_elsewhere) == (0, 1)  # the store is one partition
    assert [world.get(job) for job in jobs] == jobs and world.broker.tries == 0
    # and it did not release the other's lease
    assert not world.store.acquire_lease(LEASE_NAME, "third", LEASE_TTL)
    assert world.store.renew_lease(LEASE_NAME, "someone-else", LEASE_TTL)


def test_an_expired_lease_does_not_block_a_pass(world: World) -> None:
    job = world.put(State.RUNNING)
    assert world.store.acquire_lease(LEASE_NAME, "crashed-node", LEASE_TTL)
    world.advance(RUNNING_TIMEOUT)
    report = world.run()
    assert (report.timed_out, report.partitions, report.held_elsewhere) == (1, 1, 0)
    assert world.state(job) is State.TIMEOUT


def test_the_lease_is_released_at_the_end_of_every_pass(world: World) -> None:
    # Two passes in a row both run; after each, another node can take the lease at once
    world.put(State.SCHEDULED)
    world.advance(REPLAY_AGE)
    assert world.reconciler.run_pass().ran
    assert world.new_reconciler("other").run_pass().ran
    assert world.store.acquire_lease(LEASE_NAME, "next", LEASE_TTL)
    assert world.store.release_lease(LEASE_NAME, "next")
    # also after a pass that met store errors ...
    fail_writes_of(world, {world.put(State.SCHEDULED).ref})
    world.advance(REPLAY_AGE)
    assert world.reconciler.run_pass().errors == 1
    assert world.store.acquire_lease(LEASE_NAME, "next", LEASE_TTL)
    assert world.store.release_lease(LEASE_NAME, "next")
    # ... and after one that raised (a bug, not a store error)
    world.hooked.before.clear()
    world.put(State.SCHEDULED, PLAIN)
    world.advance(REPLAY_AGE)

    def broken(*args: Any) -> None:
        raise RuntimeError("bug in a publisher")

    world.reconciler.runtime.dispatcher.publisher = broken
    with pytest.raises(RuntimeError):
        world.reconciler.run_pass()
    assert world.store.acquire_lease(LEASE_NAME, "next", LEASE_TTL)


def test_a_reconciler_that_lost_its_lease_mid_pass_stops(world: World) -> None:
    # Given stale RUNNING jobs, and a pass whose lease expires (a long pause) right after
    # it listed them, while another reconciler takes the lease
    jobs = [world.put(State.RUNNING) for _ in range(3)]
    world.advance(RUNNING_TIMEOUT)

    def pause(listed: list[Job]) -> None:
        world.advance(LEASE_TTL)
        assert world.store.acquire_lease(LEASE_NAME, "the-other-reconciler", LEASE_TTL)

    after_listing(world, State.RUNNING, pause)
    report = world.reconciler.run_pass()
    # Then its guarded writes are refused and the pass stops at the first
    assert report.lease_lost and report.timed_out == 0
    assert all(world.state(job) is State.RUNNING for job in jobs)
    assert metrics.COUNTERS.get("reconcile_lease_lost") == 1


def test_two_reconcilers_one_pausing_past_its_lease_act_once_on_each_job(world: World) -> None:
    # Given stale jobs of every kind
    jobs = [
        world.put(State.SCHEDULED),
        world.put(State.SCHEDULED, PLAIN),
        world.put(State.DISPATCHED, PLAIN),
        world.put(State.RUNNING),
        world.put(State.RUNNING, RERUN),
        world.put(State.DISPATCHED, REDISPATCH),
    ]
    world.advance(RUNNING_TIMEOUT)
    other = world.new_reconciler("other")
    # When reconciler A pauses past its lease after listing, and B runs a whole pass meanwhile
    paused: list[PassReport] = []

    def pause(listed: list[Job]) -> None:
        if not paused:
            world.advance(LEASE_TTL)
            world.hooked.after.clear()
            paused.append(other.run_pass())

    after_listing(world, State.SCHEDULED, pause)
    first = world.reconciler.run_pass()
    # Then B did everything, A nothing more, and every job was acted on once
    assert paused[0].ran and paused[0].replayed == 2
    assert first.replayed == first.timed_out == first.rerun == first.redispatched == 0
    assert world.broker.count() == {
        (jobs[0].ref.id, 0): 1,
        (jobs[1].ref.id, 0): 1,
        (jobs[4].ref.id, 1): 1,
        (jobs[5].ref.id, 0): 1,
    }
    assert [world.state(job) for job in jobs] == [
        State.DISPATCHED,
        State.PUBLISHED,
        State.TIMEOUT,
        State.TIMEOUT,
        State.DISPATCHED,
        State.DISPATCHED,
    ]


def test_a_reconciler_that_lost_its_lease_replays_nothing(world: World) -> None:
    job = world.put(State.SCHEDULED)
    world.advance(REPLAY_AGE)

    def pause(listed: list[Job]) -> None:
        world.advance(LEASE_TTL)
        assert world.store.acquire_lease(LEASE_NAME, "the-other-reconciler", LEASE_TTL)

    after_listing(world, State.SCHEDULED, pause)
    world.reconciler.run_pass()
    assert world.broker.sent == [] and world.state(job) is State.SCHEDULED


def test_a_pass_end_the_store_refused_is_recorded_before_the_next_pass(world: World) -> None:
    runner = reconcile_task.BeatRunner(world.reconciler.runtime, threaded=False)
    refusing = True

    def refuse_ends(ref: JobRef, request: Transition) -> None:
        if refusing and request.to is State.SUCCEEDED:
            raise exceptions.StoreUnavailable("injected: the end of the pass is lost")

    world.hooked.before["transition"] = refuse_ends
    # Given a pass whose end the store refused, and the next one's too
    first = world.put(State.SCHEDULED, PLAIN)
    runner.start(first)
    assert world.state(first) is State.RUNNING
    second = world.put(State.SCHEDULED, PLAIN)
    runner.start(second)
    assert [world.state(job) for job in (first, second)] == [State.RUNNING] * 2
    # When the store takes writes again and another pass comes
    refusing = False
    third = world.put(State.SCHEDULED, PLAIN)
    runner.start(third)
    # Then every pass is recorded as ended, once, and nothing is left for a timeout
    for job in (first, second, third):
        after = world.get(job)
        assert after.state is State.SUCCEEDED
        assert [h.dst for h in after.history].count(State.SUCCEEDED) == 1
    world.advance(3600)
    assert world.run().timed_out == 0
