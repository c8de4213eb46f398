"""SCHEDULED jobs left behind (beat died between claim and publish): the replay and its caps.

Replayed once through the dispatch path, never past the job's deadline,
given up (FAILED, with the reason) after ``MAX_REPLAYS`` refused publishes, and
the replay of a retried job's later attempt.
"""

from __future__ import annotations

from datetime import timedelta

from celery_exactonce.core.states import State
from celery_exactonce.dispatch.publisher import PublishFailed
from celery_exactonce.observe import metrics
from celery_exactonce.reconcile.reconciler import MAX_REPLAYS
from tests.support.reconciler_world import REPLAY_AGE, START, World, retried
from tests.support.reconciling import GATED, PLAIN, entries, move


def test_stale_scheduled_jobs_are_replayed_exactly_once(world: World) -> None:
    # Given a gated and a plain job left SCHEDULED (beat died between claim and publish)
    gated, plain = world.put(State.SCHEDULED), world.put(State.SCHEDULED, PLAIN)
    world.advance(REPLAY_AGE)
    # When passes run, for as long as the replayed gated job is not timed out
    report = world.run()
    for _ in range(50):
        world.advance(60)
        world.run()
    # Then each was published once, through the dispatch path
    assert report.replayed == 2 and report.stale["SCHEDULED"] == 2
    assert sorted(world.broker.sent) == sorted([(gated.ref.id, 0), (plain.ref.id, 0)])
    replayed = world.get(gated)
    assert replayed.state is State.DISPATCHED and replayed.dispatches == 1
    assert [h.reason for h in entries(replayed, src=State.SCHEDULED)] == ["reconciler replay"]
    assert world.state(plain) is State.PUBLISHED
    assert metrics.COUNTERS.get("replayed") == 2


def test_replay_never_goes_past_the_jobs_deadline(world: World) -> None:
    # Given two stale SCHEDULED jobs: one past its deadline, one not
    late = world.put(State.SCHEDULED, deadline=START + timedelta(seconds=30))
    in_time = world.put(State.SCHEDULED, deadline=START + timedelta(hours=1))
    world.advance(REPLAY_AGE)
    # When a pass runs
    report = world.run()
    # Then the late one is CANCELLED, never published; the other is replayed
    cancelled = world.get(late)
    assert cancelled.state is State.CANCELLED and "deadline" in cancelled.reason
    assert world.broker.sent == [(in_time.ref.id, 0)]
    assert (report.cancelled, report.replayed) == (1, 1)


def test_replays_are_bounded_then_the_job_fails_with_the_reason(world: World) -> None:
    # Given a stale SCHEDULED job whose every publish is refused (rolled back each time)
    job = world.put(State.SCHEDULED)
    world.broker.fault = PublishFailed("connection refused", definite=True)
    passes = 0
    # When passes run, each after the replay age
    while world.state(job) is State.SCHEDULED and passes < 3 * MAX_REPLAYS:
        world.advance(REPLAY_AGE)
        world.run()
        passes += 1
    # Then it was tried MAX_REPLAYS times and is then FAILED with the reason, counted
    failed = world.get(job)
    assert failed.state is State.FAILED and f"replayed {MAX_REPLAYS} times" in failed.reason
    assert world.broker.tries == MAX_REPLAYS and passes == MAX_REPLAYS + 1
    assert metrics.COUNTERS.get("replay_gave_up") == 1
    world.broker.fault = None
    world.advance(REPLAY_AGE)
    world.run()
    assert world.broker.sent == [] and world.get(job) == failed


def test_a_retried_job_whose_publish_was_refused_is_replayed(world: World) -> None:
    # Given a job retried 5 times; the publish of its 5th retry was refused (rolled back)
    job = retried(world, GATED, 5)
    job = move(world.store, job, State.SCHEDULED, reason="publish failed: refused")
    assert (job.attempt, job.dispatches) == (5, 6)
    world.advance(REPLAY_AGE)
    # When a pass runs
    world.run()
    # Then it is replayed (attempt 5, never dispatched by the reconciler yet)
    assert world.broker.sent == [(job.ref.id, 5)]
