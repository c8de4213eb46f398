"""The reconciler on every backend, in real (store) time, with timeouts of a fraction of a second.

The exact thresholds are pinned on a frozen clock in ``tests/unit/reconcile/``;
here every rule is shown on each real store, with ages checked on the store's own
timestamps (a job's history) rather than on this process's clock.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from celery_exactonce.core import exceptions
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.dispatch.publisher import PublishFailed
from celery_exactonce.reconcile import reconciler
from celery_exactonce.reconcile.passes import lease_holder
from celery_exactonce.reconcile.reconciler import LEASE_NAME, PassReport, Reconciler
from celery_exactonce.stores.base import StateStore, partitions_of
from tests.support.backends import StoreFactory
from tests.support.helpers import poll, wait_store_past
from tests.support.reconciling import (
    DISPATCH_DEADLINE,
    DISPATCH_TIMEOUT,
    GATED,
    NODE,
    PLAIN,
    REDISPATCH,
    REPLAY_AGE,
    RERUN,
    RUNNING_TIMEOUT,
    Broker,
    HookedStore,
    current,
    flaky_writes,
    gate,
    make_app,
    move,
    put,
    reconciler_on,
)
from tests.support.reconciling import QUICK_SETTINGS as SETTINGS

#: The default timeouts (a minute and more), heartbeats often enough that a running
#: timeout under a second is consistent.
LONG_SETTINGS: dict[str, Any] = {
    "exactonce_heartbeat_interval": 0.05,
    "exactonce_max_skew": 0.0,
}

FAST_REDISPATCH = "rec.fast_redispatch"
PATIENT = "rec.patient"
PATIENT_PLAIN = "rec.patient_plain"
QUICK = "rec.quick"
PLAIN_REDISPATCH = "rec.plain_redispatch"
TASKS: dict[str, dict[str, Any]] = {
    FAST_REDISPATCH: {
        "exactonce_redispatch": True,
        "exactonce_dispatch_timeout": 0.3,
        "exactonce_dispatch_deadline": 3.0,
    },
    PATIENT: {"exactonce_running_timeout": 60, "exactonce_dispatch_deadline": 60},
    PATIENT_PLAIN: {"gated": False, "exactonce_dispatch_timeout": 60},
    PLAIN_REDISPATCH: {"gated": False, "exactonce_redispatch": True},
}
#: In the app with LONG_SETTINGS (a gated dispatch_deadline cannot go below replay_age
#: there: dispatch timeouts are shortened in the unit tests).
LONG_TASKS: dict[str, dict[str, Any]] = {QUICK: {"exactonce_running_timeout": 0.3}}

#: How long any polled condition may take.
PATIENCE = 15.0
#: The running timeout of the test with a live job, whose heartbeats must land in time.
LIVE_TIMEOUT = 1.5


class Scene:
    """An app, a store client (hooked), a fake broker and a reconciler; jobs put in it."""

    def __init__(
        self,
        factory: StoreFactory,
        settings: dict[str, Any] = SETTINGS,
        *,
        tasks: dict[str, dict[str, Any]] = TASKS,
        store: StateStore | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.factory = factory
        self.store = store or factory()
        self.hooked = HookedStore(self.store)
        self.broker = Broker()
        self.app = make_app(settings, tasks)
        self.reconciler = self.new_reconciler(monotonic=monotonic)

    def new_reconciler(
        self,
        store: StateStore | HookedStore | None = None,
        *,
        node: str = "reconciler",
        monotonic: Callable[[], float] = time.monotonic,
    ) -> Reconciler:
        store = store or self.hooked
        return reconciler_on(self.app, store, self.broker, node=node, monotonic=monotonic)  # type: ignore[arg-type]

    def put(self, state: State, task: str = GATED, **kwargs: Any) -> Job:
        return put(self.store, self.app, state, task, **kwargs)

    def get(self, job: Job) -> Job:
        return current(self.store, job)

    def state(self, job: Job) -> State:
        return self.get(job).state

    def run(self) -> PassReport:
        report = self.reconciler.run_pass()
        assert report.ran
        return report

    def until(
        self, check: Callable[[], bool], timeout: float = PATIENCE, *, lease_free: bool = True
    ) -> list[PassReport]:
        """Run passes until ``check()`` holds; the reports of those passes.

        With ``lease_free`` (no other reconciler, no lost lease write), each pass must run.
        """
        reports: list[PassReport] = []

        def step() -> bool:
            reports.append(self.run() if lease_free else self.reconciler.run_pass())
            return check()

        poll(step, timeout=timeout)
        return reports

    def wait_stale(self, job: Job, seconds: float) -> None:
        """Wait until, by the store's clock, ``job`` was last touched ``seconds`` ago."""
        wait_store_past(self.store, job.touched_at + timedelta(seconds=seconds))


def age_when(job: Job, dst: State, *, nth: int = 0) -> float:
    """Seconds (store time) the job had been in its previous state when it went to ``dst``."""
    history = list(job.history)
    hits = [i for i, h in enumerate(history) if h.dst is dst and i > 0]
    i = hits[nth]
    return (history[i].at - history[i - 1].at).total_seconds()


@pytest.fixture
def scene(store_factory: StoreFactory) -> Scene:
    return Scene(store_factory)


# -- SCHEDULED ----------------------------------------------------------------------------


def test_stale_scheduled_jobs_are_replayed_once_never_past_their_deadline(scene: Scene) -> None:
    # Given a gated and a plain job left SCHEDULED, and one whose deadline comes first
    gated, plain = scene.put(State.SCHEDULED), scene.put(State.SCHEDULED, PLAIN)
    late = scene.put(State.SCHEDULED, deadline=scene.store.now() + timedelta(seconds=0.05))
    # When passes run until they are resolved, and then for another replay age
    jobs = (gated, plain, late)
    reports = scene.until(lambda: all(scene.state(job) is not State.SCHEDULED for job in jobs))
    again = scene.store.now() + timedelta(seconds=REPLAY_AGE + 0.05)
    reports += scene.until(lambda: scene.store.now() > again)
    # Then each was published once, after the replay age; the late one never
    assert sorted(scene.broker.sent) == sorted([(gated.ref.id, 0), (plain.ref.id, 0)])
    assert sum(r.replayed for r in reports) == 2 and sum(r.cancelled for r in reports) == 1
    assert scene.state(plain) is State.PUBLISHED
    for job in (gated, plain):
        assert age_when(scene.get(job), State.DISPATCHED) >= REPLAY_AGE
    cancelled = scene.get(late)
    assert cancelled.state is State.CANCELLED and "deadline" in cancelled.reason


def test_replays_are_bounded_then_the_job_fails(
    scene: Scene, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reconciler, "MAX_REPLAYS", 2)
    job = scene.put(State.SCHEDULED)
    scene.broker.fault = PublishFailed("connection refused", definite=True)
    reports = scene.until(lambda: scene.state(job) is State.FAILED)
    failed = scene.get(job)
    assert "replayed 2 times" in failed.reason
    assert scene.broker.tries == 2 and scene.broker.sent == []
    assert sum(r.failed for r in reports) == 1


# -- DISPATCHED ---------------------------------------------------------------------------


def test_dispatched_plain_times_out_unconfirmed_gated_at_the_deadline(scene: Scene) -> None:
    # Given DISPATCHED jobs whose fate is unknown: plain ones (one opting in to
    # redispatch, which a plain job cannot have) and a gated one not opted in
    plain, plain_opted = (
        scene.put(State.DISPATCHED, PLAIN),
        scene.put(State.DISPATCHED, PLAIN_REDISPATCH),
    )
    gated = scene.put(State.DISPATCHED)
    jobs = (plain, plain_opted, gated)
    # When passes run until all are resolved
    scene.until(lambda: all(scene.state(job) is State.TIMEOUT for job in jobs))
    # Then the plain ones timed out 'unconfirmed' after dispatch_timeout, the gated one
    # only after dispatch_deadline, and none was ever republished
    for job in (plain, plain_opted):
        after = scene.get(job)
        assert after.reason == "unconfirmed"
        assert age_when(after, State.TIMEOUT) >= DISPATCH_TIMEOUT
    after = scene.get(gated)
    assert "dispatch_deadline" in after.reason
    assert age_when(after, State.TIMEOUT) >= DISPATCH_DEADLINE
    assert scene.broker.tries == 0


def test_opted_in_redispatch_backs_off_and_is_capped(
    scene: Scene, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an opted-in gated job whose message was lost (its task: dispatch_timeout
    # 0.3 s, dispatch_deadline 3 s: a pass may run seconds late on a loaded machine),
    # at most two redispatches per job
    monkeypatch.setattr(reconciler, "MAX_REDISPATCHES", 2)
    job = scene.put(State.DISPATCHED, FAST_REDISPATCH)
    # When passes run until it is resolved
    scene.until(lambda: scene.state(job) is State.TIMEOUT)
    # Then it was redispatched after 0.3 s, then after 0.6 s, then no more (the next
    # two would be due 1.2 s and 2.4 s later, before the deadline: the cap); it timed
    # out at the deadline
    after = scene.get(job)
    assert scene.broker.sent == [(job.ref.id, 0)] * 2
    first, second = (age_when(after, State.DISPATCHED, nth=n) for n in (1, 2))
    assert first >= 0.3 and second >= 0.6
    assert age_when(after, State.TIMEOUT) >= 3.0


def test_redispatch_budget_per_pass(scene: Scene, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reconciler, "REDISPATCH_BUDGET", 2)
    jobs = [scene.put(State.DISPATCHED, FAST_REDISPATCH) for _ in range(3)]
    scene.wait_stale(jobs[-1], 0.3)
    counts = [scene.run().redispatched, scene.run().redispatched]
    assert counts == [2, 1]
    assert sorted(scene.broker.ids()) == sorted(job.ref.id for job in jobs)


# -- RUNNING ------------------------------------------------------------------------------


class Heartbeats:
    """A worker's heartbeat thread (its own store client), every 50 ms until stopped."""

    def __init__(self, store: StateStore, job: Job) -> None:
        self._stop = threading.Event()
        self.store, self.job = store, job
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        # As the worker's own thread: a beat the store refuses (a busy SQLite file under
        # a pass every 5 ms) is tried again at the next one, never the end of the thread.
        while not self._stop.wait(0.05):
            with contextlib.suppress(exceptions.StoreError):
                self.store.heartbeat(self.job.ref, self.job.run_id or "")

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=5)


def test_running_jobs_without_heartbeat_time_out_or_rerun(store_factory: StoreFactory) -> None:
    # A running timeout of 30 heartbeats: a loaded machine may hold the heartbeat thread
    # (or, on SQLite, its write) back for longer than the quick settings' 0.6 s.
    scene = Scene(store_factory, {**SETTINGS, "exactonce_running_timeout": LIVE_TIMEOUT})
    # Given a live job (its worker heartbeats), a dead one, and a dead one opted in to re-run
    live, dead, rerun = (
        scene.put(State.RUNNING),
        scene.put(State.RUNNING),
        scene.put(State.RUNNING, RERUN),
    )
    beats = Heartbeats(scene.factory(), live)
    try:
        # When passes run until the dead ones are resolved, and then for a running_timeout more
        scene.until(
            lambda: scene.state(dead) is State.TIMEOUT and scene.state(rerun) is State.DISPATCHED
        )
        wait_until = scene.store.now() + timedelta(seconds=LIVE_TIMEOUT + 0.05)
        scene.until(lambda: scene.store.now() > wait_until)
        # Then the live job runs on
        assert scene.state(live) is State.RUNNING
    finally:
        beats.stop()
    after = scene.get(dead)
    assert after.reason.startswith("no heartbeat")
    assert age_when(after, State.TIMEOUT) >= LIVE_TIMEOUT
    # and the opted-in one is its next attempt, published once
    again = scene.get(rerun)
    assert (again.attempt, again.run_id) == (1, None)
    assert age_when(again, State.DISPATCHED, nth=1) >= LIVE_TIMEOUT
    assert scene.broker.sent == [(rerun.ref.id, 1)]


def test_task_attributes_lengthen_the_settings(scene: Scene) -> None:
    patient = [
        scene.put(State.RUNNING, PATIENT),
        scene.put(State.DISPATCHED, PATIENT),
        scene.put(State.DISPATCHED, PATIENT_PLAIN),
    ]
    default = [
        scene.put(State.RUNNING),
        scene.put(State.DISPATCHED),
        scene.put(State.DISPATCHED, PLAIN),
    ]
    scene.until(lambda: all(scene.state(job) is State.TIMEOUT for job in default))
    assert [scene.get(job) for job in patient] == patient


def test_fresh_jobs_are_left_alone_a_task_attribute_shortens_the_setting(
    store_factory: StoreFactory,
) -> None:
    # An app with the default timeouts (a minute and more), and a task whose running_timeout
    # is under a second: jobs of every other kind stay fresh throughout
    scene = Scene(store_factory, LONG_SETTINGS, tasks=LONG_TASKS)
    quick = scene.put(State.RUNNING, QUICK)
    fresh = [
        scene.put(state, task)
        for state in (State.SCHEDULED, State.DISPATCHED, State.RUNNING)
        for task in (GATED, PLAIN, REDISPATCH, RERUN, QUICK)
        if not (state is State.RUNNING and task in (PLAIN, QUICK))
    ]
    reports = scene.until(lambda: scene.state(quick) is State.TIMEOUT)
    assert age_when(scene.get(quick), State.TIMEOUT) >= 0.3
    assert [scene.get(job) for job in fresh] == fresh
    assert scene.broker.tries == 0 and not any(r.errors for r in reports)


# -- terminal: purge ------------------------------------------------------------------------


def test_terminal_records_past_retention_are_purged(store_factory: StoreFactory) -> None:
    scene = Scene(store_factory, store=store_factory(retention=0.2))
    done = [scene.put(State.SUCCEEDED), scene.put(State.TIMEOUT), scene.put(State.PUBLISHED, PLAIN)]
    later = scene.store.create(
        NewJob(
            JobRef.submitted("next-year"),
            GATED,
            State.PENDING,
            node=NODE,
            run_at=scene.store.now() + timedelta(days=365),
        )
    ).job
    reports = scene.until(lambda: all(scene.store.get(job.ref) is None for job in done))
    assert sum(r.expired for r in reports) == len(done)
    assert later is not None and scene.get(later) == later


# -- the lease ----------------------------------------------------------------------------


def test_the_lease_another_token_holds_it_then_each_pass_releases_it(scene: Scene) -> None:
    # Given a stale job, and the lease held by another reconciler
    job = scene.put(State.SCHEDULED)
    assert scene.store.acquire_lease(LEASE_NAME, "someone-else", 60)
    scene.wait_stale(job, REPLAY_AGE)
    # When a pass runs, it does nothing, and leaves the other's lease alone
    report = scene.reconciler.run_pass()
    assert report.ran is False and scene.get(job) == job and scene.broker.tries == 0
    assert scene.store.renew_lease(LEASE_NAME, "someone-else", 60)
    assert scene.store.release_lease(LEASE_NAME, "someone-else")
    # Then, the lease free, a pass runs; right after it another reconciler's pass runs,
    # and after that anyone can take the lease at once
    assert scene.run().replayed == 1
    assert scene.new_reconciler(scene.factory(), node="other").run_pass().ran
    assert scene.store.acquire_lease(LEASE_NAME, "next", 60)


def test_a_second_reconciler_reconciles_the_partitions_the_first_does_not_hold(
    scene: Scene,
) -> None:
    # Given stale jobs on each partition of the store (it is one, but for a sharded store)
    parts = partitions_of(scene.store)
    homes: dict[int, list[Job]] = {i: [] for i in range(len(parts))}
    for _ in range(200):
        job = scene.put(State.SCHEDULED, PATIENT)
        home = next(i for i, part in enumerate(parts) if part.get(job.ref) is not None)
        homes[home].append(job)
        if all(len(jobs) >= 3 for jobs in homes.values()):
            break
    everything = [job for jobs in homes.values() for job in jobs]
    assert all(len(jobs) >= 3 for jobs in homes.values())
    scene.wait_stale(max(everything, key=lambda job: job.touched_at), REPLAY_AGE)
    # When reconciler A, having listed its first partition (its lease held), waits while
    # reconciler B, another node with its own client, runs a whole pass
    other = HookedStore(scene.factory())
    listed_by_a: list[JobRef] = []
    holders_seen: list[list[str | None]] = []
    passes: list[PassReport] = []

    def holders() -> list[str | None]:
        held = [part.lease(LEASE_NAME) for part in parts]
        return [None if h is None else lease_holder(h[0]) for h in held]

    def b_listed(listed: list[Job], state: State, *args: Any, **kwargs: Any) -> list[Job]:
        if State(state) is State.SCHEDULED and listed and not holders_seen:
            holders_seen.append(holders())
        return listed

    def a_listed(listed: list[Job], state: State, *args: Any, **kwargs: Any) -> list[Job]:
        if State(state) is State.SCHEDULED and listed and not passes:
            listed_by_a.extend(job.ref for job in listed)
            passes.append(scene.new_reconciler(other, node="other").run_pass())
        return listed

    other.after["list_stale"] = b_listed
    scene.hooked.after["list_stale"] = a_listed
    first = scene.reconciler.run_pass()
    # Then B skipped only A's partition, and while B worked, each held a partition of its own
    (second,) = passes
    assert (second.ran, second.partitions, second.held_elsewhere) == (
        len(parts) > 1,
        len(parts) - 1,
        1,
    )
    assert (first.ran, first.partitions, first.held_elsewhere) == (True, len(parts), 0)
    if len(parts) > 1:
        (seen,) = holders_seen
        assert sorted(holder for holder in seen if holder) == ["other", "reconciler"]
    # and between them every stale job was replayed once: A its first partition's, B the rest
    assert first.replayed == len(listed_by_a)
    assert first.replayed + second.replayed == len(everything)
    assert scene.broker.count() == Counter((job.ref.id, 0) for job in everything)
    assert holders() == [None] * len(parts)


# -- racing -------------------------------------------------------------------------------


def test_concurrent_reconcilers_act_once_on_each_job(store_factory: StoreFactory) -> None:
    # Given stale jobs of every kind, and a lease shorter than a pass on most stores, so
    # that passes overlap (a reconciler loses its lease mid-pass, another takes it)
    scene = Scene(store_factory, {**SETTINGS, "exactonce_lease_ttl": 0.1})
    kinds = [
        (State.SCHEDULED, GATED),
        (State.SCHEDULED, PLAIN),
        (State.DISPATCHED, PLAIN),
        (State.RUNNING, GATED),
        (State.RUNNING, RERUN),
    ]
    jobs = {(state, task): [scene.put(state, task) for _ in range(6)] for state, task in kinds}
    everything = [job for group in jobs.values() for job in group]
    scene.wait_stale(everything[-1], RUNNING_TIMEOUT)
    # When three reconcilers, each with its own store client, run passes at once
    reconcilers = [scene.new_reconciler(store_factory(), node=f"reconciler-{i}") for i in range(3)]
    done = threading.Event()
    barrier = threading.Barrier(len(reconcilers))
    reports: list[PassReport] = []
    failures: list[BaseException] = []

    def run(rec: Reconciler) -> None:
        try:
            barrier.wait(timeout=30)
            while not done.is_set():
                reports.append(rec.run_pass())
        except BaseException as exc:
            failures.append(exc)
            raise

    threads = [threading.Thread(target=run, args=(rec,)) for rec in reconcilers]
    for thread in threads:
        thread.start()
    try:
        poll(lambda: all(scene.state(job) is not job.state for job in everything), timeout=PATIENCE)
    finally:
        done.set()
        for thread in threads:
            thread.join(timeout=30)
    # Then each job was acted on once: one publish per replay or re-run, none twice
    assert not failures
    assert all(n == 1 for n in scene.broker.count().values())
    assert len(scene.broker.sent) == 3 * 6
    assert sum(r.replayed for r in reports) == 12 and sum(r.rerun for r in reports) == 6
    for job in jobs[State.RUNNING, RERUN]:
        assert scene.get(job).attempt == 1


def test_a_worker_acting_right_after_the_listing_wins(scene: Scene) -> None:
    # Given stale jobs, and a worker (its own client) that acts on each right after the
    # reconciler listed it: the gate takes the gated ones, the publish of the plain one
    # returns, a heartbeat lands on the running one
    worker = scene.factory()
    jobs = [
        scene.put(State.SCHEDULED),
        scene.put(State.DISPATCHED),
        scene.put(State.DISPATCHED, PLAIN),
        scene.put(State.RUNNING),
    ]
    scene.wait_stale(jobs[-1], DISPATCH_DEADLINE)

    def act(result: list[Job], state: State, *args: Any, **kwargs: Any) -> list[Job]:
        for job in result:
            if job.ref not in {j.ref for j in jobs}:
                continue
            if job.state is State.RUNNING:
                assert worker.heartbeat(job.ref, job.run_id or "")
            elif job.task == PLAIN:
                move(worker, job, State.PUBLISHED, reason="publish returned")
            else:
                gate(worker, job)
        return result

    scene.hooked.after["list_stale"] = act
    # When a pass acts on what it listed
    report = scene.run()
    # Then the worker's moves stand: no TIMEOUT, no replay
    assert [scene.state(job) for job in jobs] == [
        State.RUNNING,
        State.RUNNING,
        State.PUBLISHED,
        State.RUNNING,
    ]
    assert report.timed_out == report.replayed == 0 and scene.broker.tries == 0


# -- faults -------------------------------------------------------------------------------


class Skewed:
    """The reconciler's own clock: this process's, moved on by ``offset``."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


class Monotonic:
    """The reconciler's own clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_with_a_tenth_of_writes_failing_a_pass_is_bounded_and_nothing_runs_twice(
    store_factory: StoreFactory,
) -> None:
    # Given stale jobs of every kind, and a store client where 10% of writes fail
    # (half before applying, half after: the answer is lost); a lease whose release
    # failed is held until its short TTL
    clock = Skewed()
    scene = Scene(store_factory, {**SETTINGS, "exactonce_lease_ttl": 0.2}, monotonic=clock)
    kinds = [
        (State.SCHEDULED, GATED),
        (State.SCHEDULED, PLAIN),
        (State.DISPATCHED, PLAIN),
        (State.RUNNING, GATED),
        (State.RUNNING, RERUN),
    ]
    jobs = [scene.put(state, task) for state, task in kinds for _ in range(6)]
    scene.wait_stale(jobs[-1], RUNNING_TIMEOUT)
    flaky_writes(scene.hooked, rate=0.10, seed=7)
    # When passes run
    errors = 0
    for _ in range(15):
        calls = sum(scene.hooked.calls.values())
        report = scene.reconciler.run_pass()
        # Then each returns, having made a bounded number of store calls
        assert sum(scene.hooked.calls.values()) - calls <= 4 * len(jobs) + 10
        errors += report.errors
    assert errors > 0
    # and once the faults stop (and the failed jobs' back-off is over), every job is
    # acted on, none published twice
    scene.hooked.before.clear()
    scene.hooked.after.clear()
    clock.offset += reconciler.RETRY_BACKOFF_MAX
    scene.until(lambda: all(scene.get(job).rev != job.rev for job in jobs), lease_free=False)
    assert all(n == 1 for n in scene.broker.count().values())
    assert len(scene.broker.sent) == 3 * 6  # the replays and the re-runs


def test_a_store_outage_longer_than_running_timeout_times_out_no_live_job(
    store_factory: StoreFactory,
) -> None:
    mono = Monotonic()
    scene = Scene(store_factory, monotonic=mono)
    live, dead = scene.put(State.RUNNING), scene.put(State.RUNNING)
    plain = scene.put(State.DISPATCHED, PLAIN)
    # Given an outage longer than running_timeout (no heartbeat could be written)
    scene.hooked.down = True
    outage_end = scene.store.now() + timedelta(seconds=RUNNING_TIMEOUT + 0.1)
    partitions = len(partitions_of(scene.store))

    def failed_pass() -> bool:
        report = scene.reconciler.run_pass()
        assert not report.ran and report.errors == partitions  # each one's lease refused
        mono.now += 0.02  # the reconciler's clock runs with the store's
        return scene.store.now() > outage_end

    poll(failed_pass, timeout=PATIENCE)
    scene.hooked.down = False
    # When the store is back, the live worker heartbeats again and passes run
    # within the grace period (running_timeout on the reconciler's clock)
    assert scene.store.heartbeat(live.ref, live.run_id or "")
    reports = [scene.run() for _ in range(3)]
    # Then nothing timed out, though the dead jobs are long stale
    assert not any(r.timed_out for r in reports)
    assert [scene.state(job) for job in (live, dead, plain)] == [
        State.RUNNING,
        State.RUNNING,
        State.DISPATCHED,
    ]
    # and past the grace, the dead ones time out, the live one (heartbeating) does not
    mono.now += RUNNING_TIMEOUT
    assert scene.store.heartbeat(live.ref, live.run_id or "")
    assert scene.run().timed_out == 2
    assert [scene.state(job) for job in (live, dead, plain)] == [
        State.RUNNING,
        State.TIMEOUT,
        State.TIMEOUT,
    ]


def test_a_hundred_failing_jobs_at_the_head_do_not_starve_the_rest(scene: Scene) -> None:
    # Given 100 stale SCHEDULED jobs whose writes always fail, the oldest of all
    news = [
        NewJob(JobRef.submitted(f"poison-{i}"), GATED, State.SCHEDULED, node=NODE)
        for i in range(100)
    ]
    poison = [result.job for result in scene.store.create_many(news) if result.job]
    refs = {job.ref for job in poison}
    others = [
        scene.put(state, task)
        for state, task in [
            (State.SCHEDULED, GATED),
            (State.SCHEDULED, PLAIN),
            (State.DISPATCHED, PLAIN),
            (State.RUNNING, GATED),
            (State.RUNNING, RERUN),
        ]
    ]

    def one(ref: JobRef, *args: Any, **kwargs: Any) -> None:
        if ref in refs:
            raise exceptions.StoreError("injected: cannot be written")

    def many(requests: list[tuple[JobRef, Any]], *args: Any, **kwargs: Any) -> None:
        if any(ref in refs for ref, _ in requests):
            raise exceptions.StoreError("injected: a poison job in the batch")

    scene.hooked.before["transition"], scene.hooked.before["transition_many"] = one, many
    scene.wait_stale(others[-1], RUNNING_TIMEOUT)
    # When a pass runs
    first = scene.run()
    # Then every other job was handled in it, the failures counted
    assert all(scene.get(job) != job for job in others)
    assert (first.replayed, first.timed_out, first.rerun, first.errors) == (2, 2, 1, 100)
    # and the next pass skips the failing jobs while they back off
    second = scene.run()
    assert second.skipped == 100 and second.errors == 0
    assert all(scene.get(job) == job for job in poison)
