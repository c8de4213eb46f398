"""Store faults: failing writes, outages, and the grace period after a store error.

With a tenth of the writes failing, passes stay bounded and nothing is
published twice. After any store error this process met (a pass, a beat tick,
a heartbeat), nothing times out for ``running_timeout`` on the reconciler's own
clock, so a live job whose heartbeats failed meanwhile is never timed out.
"""

from __future__ import annotations

import time

from celery_exactonce.core.states import State
from celery_exactonce.observe import metrics
from tests.support.reconciler_world import RUNNING_TIMEOUT, World
from tests.support.reconciling import GATED, PLAIN, RERUN, entries, flaky_writes


def test_with_a_tenth_of_writes_failing_passes_stay_bounded_and_nothing_runs_twice(
    world: World,
) -> None:
    # Given 240 stale jobs of every kind, and a store where 10% of writes fail
    kinds = [
        (State.SCHEDULED, GATED),
        (State.SCHEDULED, PLAIN),
        (State.DISPATCHED, PLAIN),
        (State.DISPATCHED, GATED),
        (State.RUNNING, GATED),
        (State.RUNNING, RERUN),
    ]
    jobs = [world.put(state, task) for state, task in kinds for _ in range(40)]
    world.advance(RUNNING_TIMEOUT)
    stop = flaky_writes(world.hooked, rate=0.10, seed=20260301)
    errors = 0
    # When passes run, a minute apart
    for _ in range(40):
        calls = sum(world.hooked.calls.values())
        started = time.monotonic()
        report = world.reconciler.run_pass()
        # Then each pass returns, within its bounds
        assert sum(world.hooked.calls.values()) - calls <= 4 * len(jobs) + 10
        assert time.monotonic() - started < 5
        errors += report.errors
        world.advance(60)
    assert errors > 0
    assert metrics.COUNTERS.get("fail_closed") > 0
    # and, once the store is healthy again, every job settles
    stop()
    for _ in range(200):
        world.advance(60)
        world.run()
        if all(world.get(job).terminal for job in jobs):
            break
    assert all(world.get(job).terminal for job in jobs)
    # and nothing was published twice (per job and attempt), nothing published unrecorded
    assert all(n == 1 for n in world.broker.count().values())
    for job in jobs:
        after = world.get(job)
        written = entries(after, dst=State.DISPATCHED)[1 if job.dispatches else 0 :]
        published = sum(1 for job_id, _ in world.broker.sent if job_id == job.ref.id)
        assert published <= len(written)


def test_a_store_outage_longer_than_running_timeout_times_out_no_live_job(world: World) -> None:
    # Given a live running job, one whose worker died, and a plain DISPATCHED job
    live, dead = world.put(State.RUNNING), world.put(State.RUNNING)
    plain = world.put(State.DISPATCHED, PLAIN)
    # When the store is down for 900 s (> running_timeout); a pass is tried every 30 s
    world.hooked.down = True
    for _ in range(30):
        world.advance(30)
        report = world.reconciler.run_pass()
        assert not report.ran and report.errors == 1
    last_error = world.mono()
    world.hooked.down = False
    # and then passes run every 30 s while the live worker heartbeats again
    timed_out_at = {}
    for _ in range(40):
        assert world.store.heartbeat(live.ref, live.run_id or "")
        world.advance(30)
        world.run()
        for job in (dead, plain):
            if job.ref not in timed_out_at and world.state(job) is State.TIMEOUT:
                timed_out_at[job.ref] = world.mono()
    # Then the live job never timed out; the others only once the grace period was over
    assert world.state(live) is State.RUNNING
    assert set(timed_out_at) == {dead.ref, plain.ref}
    assert min(timed_out_at.values()) >= last_error + RUNNING_TIMEOUT
    assert max(timed_out_at.values()) < last_error + RUNNING_TIMEOUT + 30


def test_an_outage_only_beat_and_the_heartbeats_saw_starts_the_grace_too(world: World) -> None:
    # Given a live running job and one whose worker died
    live, dead = world.put(State.RUNNING), world.put(State.RUNNING)
    # When the store is down for 900 s (> running_timeout): no pass runs at all (beat
    # cannot claim one), but beat's ticks and the heartbeats fail in this process
    for _ in range(30):
        world.advance(30)
        world.reconciler.runtime.note_store_error(world.mono())
    last_error = world.mono()
    # and then passes run every 30 s while the live worker heartbeats again
    timed_out_at = None
    for _ in range(40):
        world.run()
        if timed_out_at is None and world.state(dead) is State.TIMEOUT:
            timed_out_at = world.mono()
        assert world.store.heartbeat(live.ref, live.run_id or "")
        world.advance(30)
    # Then the live job never timed out; the dead one only once the grace was over
    assert world.state(live) is State.RUNNING
    assert timed_out_at is not None and timed_out_at >= last_error + RUNNING_TIMEOUT


def test_store_errors_of_a_pass_are_counted(world: World) -> None:
    world.hooked.down = True
    assert world.reconciler.run_pass().errors == 1
    assert metrics.COUNTERS.get("reconcile_store_error") == 1


def test_after_a_store_error_no_timeout_for_running_timeout(world: World) -> None:
    job = world.put(State.RUNNING)
    world.advance(RUNNING_TIMEOUT)
    # Given a pass that met a store error (the lease could not be taken)
    world.hooked.down = True
    assert world.reconciler.run_pass().errors == 1
    world.hooked.down = False
    # When the store's clock runs on but the reconciler's has not passed the grace
    world.clock.advance(10 * RUNNING_TIMEOUT)
    world.mono.advance(RUNNING_TIMEOUT - 1)
    # Then nothing times out; once past it, the job does
    assert world.run().timed_out == 0 and world.state(job) is State.RUNNING
    world.mono.advance(1)
    assert world.run().timed_out == 1
