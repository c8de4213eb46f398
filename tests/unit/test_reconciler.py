"""The reconciler on an InMemoryStore and a FrozenClock: every rule at its exact threshold,
the lease, racing workers and reconcilers, store faults and store-clock ages.

Faults are injected by wrapping the store's methods (:class:`HookedStore`); the
reconciler's own clock (grace, back-off) is a fake monotonic clock that moves
with the store's clock unless a test moves one alone.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from celery_exactonce import exceptions, metrics, reconcile_task, reconciler
from celery_exactonce.jobs import Job, JobRef, NewJob, Transition
from celery_exactonce.publisher import PublishFailed
from celery_exactonce.reconciler import LEASE_NAME, MAX_REPLAYS, PassReport
from celery_exactonce.states import State
from celery_exactonce.testing import FrozenClock, InMemoryStore
from tests.support.reconciling import (
    GATED,
    NODE,
    PLAIN,
    REDISPATCH,
    RERUN,
    Broker,
    HookedStore,
    current,
    entries,
    gate,
    make_app,
    move,
    put,
    reconciler_on,
    retry,
)

START = datetime(2026, 3, 1, 12, 0, 0, tzinfo=timezone.utc)
REPLAY_AGE = 60.0
DISPATCH_TIMEOUT = 300.0
DISPATCH_DEADLINE = 3600.0
RUNNING_TIMEOUT = 600.0
LEASE_TTL = 60.0

SETTINGS = {
    "exactonce_replay_age": REPLAY_AGE,
    "exactonce_dispatch_timeout": DISPATCH_TIMEOUT,
    "exactonce_dispatch_deadline": DISPATCH_DEADLINE,
    "exactonce_running_timeout": RUNNING_TIMEOUT,
    "exactonce_heartbeat_interval": 30.0,
    "exactonce_lease_ttl": LEASE_TTL,
}

#: Per-task overrides (task attributes), below and above the settings.
QUICK = "rec.quick"
QUICK_PLAIN = "rec.quick_plain"
SLOW = "rec.slow"
SLOW_PLAIN = "rec.slow_plain"
PLAIN_REDISPATCH = "rec.plain_redispatch"
TASKS: dict[str, dict[str, Any]] = {
    QUICK: {"exactonce_dispatch_deadline": 900, "exactonce_running_timeout": 120},
    QUICK_PLAIN: {"gated": False, "exactonce_dispatch_timeout": 120},
    SLOW: {"exactonce_dispatch_deadline": 7200, "exactonce_running_timeout": 1200},
    SLOW_PLAIN: {"gated": False, "exactonce_dispatch_timeout": 900},
    PLAIN_REDISPATCH: {"gated": False, "exactonce_redispatch": True},
}

MICROSECOND = 1e-6


class Monotonic:
    """The reconciler's own clock (grace period, back-off)."""

    def __init__(self) -> None:
        self.now = 10_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class World:
    """One app, one InMemoryStore on a FrozenClock (seen through a HookedStore), a fake broker
    and a reconciler."""

    def __init__(self, *, start: datetime = START, retention: float = 7 * 86_400.0) -> None:
        self.clock = FrozenClock(start)
        self.mono = Monotonic()
        self.store = InMemoryStore("recon", retention=retention, clock=self.clock)
        self.hooked = HookedStore(self.store)
        self.broker = Broker()
        self.app = make_app(SETTINGS, TASKS)
        self.reconciler = self.new_reconciler()

    def new_reconciler(self, node: str = "reconciler") -> reconciler.Reconciler:
        return reconciler_on(self.app, self.hooked, self.broker, node=node, monotonic=self.mono)  # type: ignore[arg-type]

    def advance(self, seconds: float) -> None:
        """Time passes for everyone: the store's clock and the reconciler's."""
        self.clock.advance(seconds)
        self.mono.advance(seconds)

    def run(self) -> PassReport:
        report = self.reconciler.run_pass()
        assert report.ran
        return report

    def put(self, state: State, task: str = GATED, **kwargs: Any) -> Job:
        return put(self.store, self.app, state, task, **kwargs)

    def get(self, job: Job) -> Job:
        return current(self.store, job)

    def state(self, job: Job) -> State:
        return self.get(job).state


@pytest.fixture(autouse=True)
def _counters() -> Iterator[None]:
    metrics.COUNTERS.reset()
    yield
    metrics.COUNTERS.reset()


@pytest.fixture
def world() -> World:
    return World()


def after_listing(world: World, state: State, act: Callable[[list[Job]], None]) -> None:
    """Run ``act`` on the jobs right after the reconciler listed the stale ones of ``state``."""

    def hook(result: list[Job], listed: State, *args: Any, **kwargs: Any) -> list[Job]:
        if State(listed) is state and result:
            act(result)
        return result

    world.hooked.after["list_stale"] = hook


def fail_writes_of(world: World, refs: set[JobRef]) -> None:
    """Every write to one of ``refs`` raises (poison jobs); the others go through."""

    def one(ref: JobRef, *args: Any, **kwargs: Any) -> None:
        if ref in refs:
            raise exceptions.StoreError(f"injected: {ref} cannot be written")

    def many(requests: list[tuple[JobRef, Any]], *args: Any, **kwargs: Any) -> None:
        if any(ref in refs for ref, _ in requests):
            raise exceptions.StoreError("injected: a poison job in the batch")

    world.hooked.before["transition"] = one
    world.hooked.before["transition_many"] = many


# -- nothing happens to fresh jobs -------------------------------------------------------


def test_fresh_jobs_are_left_alone(world: World) -> None:
    # Given a job of every kind in every live state, just under the youngest threshold
    jobs = [
        world.put(state, task)
        for state in (State.SCHEDULED, State.DISPATCHED, State.RUNNING)
        for task in (GATED, PLAIN, REDISPATCH, RERUN, QUICK, QUICK_PLAIN)
        if not (state is State.RUNNING and task in (PLAIN, QUICK_PLAIN))
    ]
    pending = world.store.create(
        NewJob(JobRef.task("later"), GATED, State.PENDING, node=NODE,
               run_at=START - timedelta(days=30))
    ).job  # fmt: skip
    assert pending is not None
    world.advance(REPLAY_AGE - MICROSECOND)
    # When passes run
    reports = [world.run() for _ in range(3)]
    # Then nothing changed, nothing was published; PENDING (the sweeper's) is never touched
    assert [world.get(job) for job in jobs] == jobs
    assert world.get(pending) == pending
    assert world.broker.tries == 0
    assert all(r.replayed == r.timed_out == r.redispatched == r.rerun == r.errors == 0
               for r in reports)  # fmt: skip


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


# -- SCHEDULED: replay ------------------------------------------------------------------


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


# -- DISPATCHED ---------------------------------------------------------------------------


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


# -- RUNNING ------------------------------------------------------------------------------


def test_running_without_heartbeat_for_running_timeout_times_out(world: World) -> None:
    # Given a running job that heartbeats, then stops (its worker died)
    job = world.put(State.RUNNING)
    world.advance(500)
    assert world.store.heartbeat(job.ref, job.run_id or "")
    world.advance(RUNNING_TIMEOUT - MICROSECOND)
    world.run()
    # Then it is RUNNING until running_timeout after its last heartbeat
    assert world.state(job) is State.RUNNING
    world.advance(MICROSECOND)
    report = world.run()
    after = world.get(job)
    assert after.state is State.TIMEOUT and after.reason == "no heartbeat for 600 s"
    assert report.timed_out == 1 and world.broker.tries == 0
    # A late outcome of the vanished run changes nothing
    done = Transition(State.SUCCEEDED, frozenset({State.RUNNING}), node="w", reason="late",
                      run_id=job.run_id)  # fmt: skip
    assert not world.store.transition(job.ref, done).applied


def test_opted_in_rerun_publishes_the_next_attempt_once(world: World) -> None:
    # Given a running job of a task that opts in to re-run, its worker gone
    job = world.put(State.RUNNING, RERUN)
    world.advance(RUNNING_TIMEOUT)
    # When passes run (short of the next attempt's own timeouts)
    report = world.run()
    for _ in range(10):
        world.advance(60)
        world.run()
    # Then the next attempt is DISPATCHED and published once
    after = world.get(job)
    assert (after.state, after.attempt, after.run_id) == (State.DISPATCHED, 1, None)
    assert report.rerun == 1 and world.broker.sent == [(job.ref.id, 1)]
    # and only a delivery of that attempt passes the gate
    assert world.get(job).attempt == 1
    run = gate(world.store, after)
    assert run.state is State.RUNNING and run.attempt == 1


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


# -- terminal: purge ------------------------------------------------------------------------


def test_terminal_records_past_retention_are_purged_live_ones_never() -> None:
    world = World(retention=1000)
    # Given terminal jobs of every kind, and a delayed job due in a year
    done = [world.put(state) for state in (State.SUCCEEDED, State.FAILED, State.CANCELLED,
                                           State.TIMEOUT)]  # fmt: skip
    done.append(world.put(State.PUBLISHED, PLAIN))
    pending = world.store.create(
        NewJob(JobRef.task("next-year"), GATED, State.PENDING, node=NODE,
               run_at=START + timedelta(days=365))
    ).job  # fmt: skip
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


# -- the lease ----------------------------------------------------------------------------


def test_a_pass_while_another_token_holds_the_lease_does_nothing(world: World) -> None:
    jobs = [world.put(State.SCHEDULED), world.put(State.DISPATCHED, PLAIN),
            world.put(State.RUNNING)]  # fmt: skip
    assert world.store.acquire_lease(LEASE_NAME, "someone-else", 10 * RUNNING_TIMEOUT)
    world.advance(RUNNING_TIMEOUT)
    report = world.reconciler.run_pass()
    assert report.ran is False and report.errors == 0
    assert [world.get(job) for job in jobs] == jobs and world.broker.tries == 0
    # and it did not release the other's lease
    assert not world.store.acquire_lease(LEASE_NAME, "third", LEASE_TTL)
    assert world.store.renew_lease(LEASE_NAME, "someone-else", LEASE_TTL)


def test_an_expired_lease_does_not_block_a_pass(world: World) -> None:
    job = world.put(State.RUNNING)
    assert world.store.acquire_lease(LEASE_NAME, "crashed-node", LEASE_TTL)
    world.advance(RUNNING_TIMEOUT)
    assert world.run().timed_out == 1 and world.state(job) is State.TIMEOUT


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
    jobs = [world.put(State.SCHEDULED), world.put(State.SCHEDULED, PLAIN),
            world.put(State.DISPATCHED, PLAIN), world.put(State.RUNNING),
            world.put(State.RUNNING, RERUN), world.put(State.DISPATCHED, REDISPATCH)]  # fmt: skip
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
        (jobs[0].ref.id, 0): 1, (jobs[1].ref.id, 0): 1, (jobs[4].ref.id, 1): 1,
        (jobs[5].ref.id, 0): 1,
    }  # fmt: skip
    assert [world.state(job) for job in jobs] == [
        State.DISPATCHED, State.PUBLISHED, State.TIMEOUT, State.TIMEOUT, State.DISPATCHED,
        State.DISPATCHED,
    ]  # fmt: skip


def test_a_reconciler_that_lost_its_lease_replays_nothing(world: World) -> None:
    job = world.put(State.SCHEDULED)
    world.advance(REPLAY_AGE)

    def pause(listed: list[Job]) -> None:
        world.advance(LEASE_TTL)
        assert world.store.acquire_lease(LEASE_NAME, "the-other-reconciler", LEASE_TTL)

    after_listing(world, State.SCHEDULED, pause)
    world.reconciler.run_pass()
    assert world.broker.sent == [] and world.state(job) is State.SCHEDULED


# -- racing -------------------------------------------------------------------------------


def test_concurrent_reconcilers_act_once_on_each_job(world: World) -> None:
    # Given many stale jobs of every kind
    kinds = [(State.SCHEDULED, GATED), (State.SCHEDULED, PLAIN), (State.DISPATCHED, PLAIN),
             (State.DISPATCHED, REDISPATCH), (State.RUNNING, GATED),
             (State.RUNNING, RERUN)]  # fmt: skip
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
        acted = [h for h in after.history
                 if h.node.startswith("reconciler") and h.reason != "publish returned"]  # fmt: skip
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


# -- faults -------------------------------------------------------------------------------


def flaky_writes(world: World, rate: float, seed: int) -> Callable[[], None]:
    """Make ``rate`` of the store's writes fail, half before and half after applying.

    Returns a function that ends the faults.
    """
    rng = random.Random(seed)
    lock = threading.Lock()
    writes = ("transition", "transition_many", "acquire_lease", "renew_lease",
              "release_lease", "purge_expired")  # fmt: skip

    def roll() -> float:
        with lock:
            return rng.random()

    def before(*args: Any, **kwargs: Any) -> None:
        if roll() < rate / 2:
            raise exceptions.StoreUnavailable("injected: write refused")

    def after(result: Any, *args: Any, **kwargs: Any) -> Any:
        if roll() < rate / 2:
            raise exceptions.StoreUnavailable("injected: write applied, answer lost")
        return result

    for name in writes:
        world.hooked.before[name] = before
        world.hooked.after[name] = after

    def stop() -> None:
        for name in writes:
            world.hooked.before.pop(name, None)
            world.hooked.after.pop(name, None)

    return stop


def test_with_a_tenth_of_writes_failing_passes_stay_bounded_and_nothing_runs_twice(
    world: World,
) -> None:
    # Given 240 stale jobs of every kind, and a store where 10% of writes fail
    kinds = [(State.SCHEDULED, GATED), (State.SCHEDULED, PLAIN), (State.DISPATCHED, PLAIN),
             (State.DISPATCHED, GATED), (State.RUNNING, GATED), (State.RUNNING, RERUN)]  # fmt: skip
    jobs = [world.put(state, task) for state, task in kinds for _ in range(40)]
    world.advance(RUNNING_TIMEOUT)
    stop = flaky_writes(world, rate=0.10, seed=20260301)
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


def test_ages_are_measured_on_the_store_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a store whose clock is 11 minutes behind this host's (the reconciler's clock
    # is 11 minutes fast: past every threshold but the gated deadline)
    world = World(start=datetime.now(timezone.utc) - timedelta(minutes=11))
    jobs = [world.put(State.SCHEDULED), world.put(State.DISPATCHED, PLAIN),
            world.put(State.RUNNING), world.put(State.DISPATCHED, REDISPATCH)]  # fmt: skip
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


def test_a_hundred_failing_jobs_at_the_head_do_not_starve_the_rest(world: World) -> None:
    # Given 100 stale SCHEDULED jobs whose every write fails, oldest of all
    poison = [world.put(State.SCHEDULED) for _ in range(100)]
    world.advance(1)
    others = [world.put(state, task) for state, task in [
        (State.SCHEDULED, GATED), (State.SCHEDULED, PLAIN), (State.DISPATCHED, PLAIN),
        (State.RUNNING, GATED), (State.RUNNING, RERUN)] for _ in range(4)]  # fmt: skip
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


def retried(world: World, task: str, retries: int) -> Job:
    """A job that ran and was retried ``retries`` times; its last attempt DISPATCHED."""
    job = world.put(State.RUNNING, task)
    for n in range(retries):
        job = retry(world.store, job)
        if n + 1 < retries:
            job = gate(world.store, job)
    return job


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


def test_redispatch_back_off_starts_afresh_with_each_attempt(world: World) -> None:
    # Given an opted-in job retried 3 times whose 4th attempt's message was lost
    job = retried(world, REDISPATCH, 3)
    world.advance(DISPATCH_TIMEOUT)
    # When a pass runs dispatch_timeout later
    world.run()
    # Then it is redispatched
    assert world.broker.sent == [(job.ref.id, 3)]


def test_a_timeout_is_reported_to_sentry_with_its_job(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    reports: list[tuple[str, dict[str, Any]]] = []

    def capture(action: str, message: str, tags: Any, exc: Any = None) -> bool:
        reports.append((action, dict(tags)))
        return True

    monkeypatch.setattr(metrics, "report_to_sentry", capture)
    # Given a running job whose worker vanished, and a live one
    dead, live = world.put(State.RUNNING), world.put(State.RUNNING)
    world.advance(RUNNING_TIMEOUT)
    assert world.store.heartbeat(live.ref, live.run_id or "")
    # When a pass times the dead one out
    assert world.run().timed_out == 1
    # Then one Sentry event names the action, the state and the job; none for the live one
    assert [(action, tags.get("job_id"), tags.get("state")) for action, tags in reports] == [
        ("timed_out", dead.ref.id, "RUNNING")
    ]


# -- the beat node's own passes -----------------------------------------------------------


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
