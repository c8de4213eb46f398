"""The reconciler's crash drills with real beat and worker processes, on every store.

A beat node SIGKILLs itself at a fault point (``apps/kill_points.py``): right
after the delayed-job sweep claimed a batch (the batch stays ``SCHEDULED``), or
right after the ``DISPATCHED`` write of a dispatch chunk, before its
publishes (that chunk stays ``DISPATCHED`` with no message, the claimed jobs
behind it ``SCHEDULED``). Another beat's reconciler settles what it left
(scenarios B7, B8, F32): ``SCHEDULED`` jobs are replayed and run once; a
gated ``DISPATCHED`` job reaches ``TIMEOUT`` at ``dispatch_deadline`` and never
runs, unless its task opted in to redispatch (``gated_redispatch``): then it
runs once. Two reconcilers act on each stale job once (H46); a reconciler
racing a worker never times out a job that ran (B9, H45).

The settings are scaled down (:data:`FAST`) so a drill takes seconds: a
``SCHEDULED`` job is replayed 2.5 s after its claim, an opted-in
``DISPATCHED`` one redispatched after 3 s, a default one timed out after 5 s.
Ledger rows (one per body run), the gate's refusals in the worker logs and
the store's records (state, history, dispatch count) are the evidence.
"""

from __future__ import annotations

import json
import re
import signal
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from celery_exactonce.core.jobs import HistoryEntry, Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.dispatch.dispatcher import DISPATCH_CHUNK
from celery_exactonce.dispatch.messages import GATED_OPTION
from celery_exactonce.reconcile.reconciler import REDISPATCH_REASON, REPLAY_REASON
from celery_exactonce.runtime import runtime_for
from tests.acceptance.apps.kill_points import killed_jobs
from tests.acceptance.apps.ledger import EXECUTION_PHASES as EXECUTIONS
from tests.acceptance.apps.ledger_app import NO_GATE
from tests.acceptance.harness import BeatProcess, Deployment, Ledger, WorkerProcess, holds, poll

STORES = ("redis", "postgres", "mysql", "sqlite")
EVERY_STORE = pytest.mark.acceptance_matrix(brokers=("redis",), stores=STORES)

REPLAY_AGE = 2.5
DISPATCH_TIMEOUT = 3.0
DISPATCH_DEADLINE = 5.0
#: The reconciler's settings, scaled down. ``replay_age`` is the least the start-up
#: check allows: 2 x (tick_interval + publish_timeout + store_timeout). A lease
#: left by a beat SIGKILLed mid-pass blocks the others for ``lease_ttl`` at most.
FAST: dict[str, Any] = {
    "exactonce_tick_interval": 0.5,
    "exactonce_publish_timeout": 0.25,
    "exactonce_store_timeout": 0.5,
    "exactonce_replay_age": REPLAY_AGE,
    "exactonce_dispatch_timeout": DISPATCH_TIMEOUT,
    "exactonce_dispatch_deadline": DISPATCH_DEADLINE,
    "exactonce_reconcile_interval": 1,
    "exactonce_lease_ttl": 2,
    "exactonce_max_skew": 0,  # a new namespace's first reconcile pass comes at once
}

KILL_AT = "EXACTONCE_ACC_KILL_AT"
#: A beat that reconciles, its delayed-job sweep off: started before a drill, it is
#: reconciling when a dying beat leaves its jobs, and it never takes them first.
RECONCILER_ONLY = {"EXACTONCE_ACC_SWEEP": "off"}
#: Reason of the sweep's claim and of its ``DISPATCHED`` write in a job's history.
SWEEP = "sweep"
#: What the gate logs when it refuses a delivery (the worker logs it at debug).
REFUSED = re.compile(r"duplicate delivery of t:(\S+) \(attempt")
#: How long a drill may take to settle once its reconciler runs.
SETTLE_TIMEOUT = 30.0
#: When delayed jobs fall due (see :func:`submit_delayed`): about when a beat started with
#: them is up.
DUE_IN = 1.0
SUBMIT_ALLOWANCE = 0.06


# --- helpers ---------------------------------------------------------------------------------


def scale_down(deployment: Deployment, **overrides: Any) -> None:
    """Every process of the deployment (sender, workers, beats) runs with :data:`FAST`."""
    conf = {**FAST, **{f"exactonce_{name}": value for name, value in overrides.items()}}
    deployment.extra_env["EXACTONCE_ACC_EXTRA_CONF"] = json.dumps(conf)


def dying(point: str) -> dict[str, str]:
    """The environment of a beat that SIGKILLs itself at ``point`` (``kill_points.py``).

    Its own reconciler waits a minute before it touches a stale job, so it does
    nothing before it dies: a replay cut by the kill would leave a job of
    another drill step ``DISPATCHED`` with no message. (A reconcile occurrence
    it claims in its last tick may be left ``SCHEDULED``: replayed, it runs as
    a reconcile pass in a worker, so the drill's reconciler is any live node.)
    """
    inert = {"replay_age": 60, "dispatch_timeout": 61, "dispatch_deadline": 62}
    conf = {**FAST, **{f"exactonce_{name}": value for name, value in inert.items()}}
    return {KILL_AT: point, "EXACTONCE_ACC_EXTRA_CONF": json.dumps(conf)}


def jobs_of(deployment: Deployment, ids: Iterable[str]) -> list[Job]:
    return [deployment.record(task_id) for task_id in ids]


def submit_delayed(
    deployment: Deployment, calls: Iterable[tuple[str, tuple[Any, ...]]]
) -> list[str]:
    """Submit a delayed job per ``(task, args)``, all with one ``eta``: due at one instant.

    The sweep that finds them due claims them all at once (in one batch). The
    ``eta`` leaves each submission time to land before it (:data:`DUE_IN` plus
    :data:`SUBMIT_ALLOWANCE` per job): a job submitted after it would not be
    delayed (``PENDING``), and the test says so.
    """
    calls = list(calls)
    runtime_for(deployment.app())  # the sender's store is open before the clock starts
    due_in = DUE_IN + SUBMIT_ALLOWANCE * len(calls)
    eta = datetime.now(timezone.utc) + timedelta(seconds=due_in)
    ids = [deployment.send(task, *args, eta=eta).id for task, args in calls]
    late = [describe(job) for job in jobs_of(deployment, ids) if job.state is not State.PENDING]
    assert not late, f"submitted too slowly: {len(late)} job(s) not PENDING: {late[:2]}"
    return ids


def wait_killed(beat: BeatProcess, point: str, timeout: float = 30.0) -> set[str]:
    """Wait until ``beat`` SIGKILLed itself at ``point``; the ids of the jobs it named."""
    try:
        poll(lambda: not beat.alive(), timeout=timeout, interval=0.05)
    except AssertionError:
        raise AssertionError(
            f"{beat!r} did not die at {point} within {timeout} s; log:\n{beat.log_tail()}"
        ) from None
    assert beat.proc is not None
    assert beat.proc.returncode == -signal.SIGKILL, (beat.proc.returncode, beat.log_tail())
    refs = killed_jobs(beat.log(), point)
    assert refs, f"{beat!r} died, but not at {point}; log:\n{beat.log_tail()}"
    return {JobRef.parse(ref).id for ref in refs}


def wait_states(
    deployment: Deployment, expected: Mapping[str, State], timeout: float = SETTLE_TIMEOUT
) -> list[Job]:
    """Poll until each job is in its expected state; the records, in ``expected``'s order."""
    found: list[Job] = []

    def reached() -> bool:
        found[:] = jobs_of(deployment, expected)
        return all(job.state is expected[job.ref.id] for job in found)

    try:
        poll(reached, timeout=timeout, interval=0.1)
    except AssertionError:
        wrong = Counter(
            (expected[job.ref.id].value, job.state.value)
            for job in found
            if job.state is not expected[job.ref.id]
        )
        raise AssertionError(
            f"not settled within {timeout} s, (expected, actual): {dict(wrong)}; e.g. "
            f"{[describe(job) for job in found if job.state is not expected[job.ref.id]][:2]}"
        ) from None
    return found


def describe(job: Job) -> str:
    steps = "; ".join(f"{h.src} -> {h.dst} ({h.reason}, {h.node})" for h in job.history)
    return f"{job.ref} {job.task} {job.state}: {steps}"


def entries(job: Job, reason: str) -> list[HistoryEntry]:
    """The job's history entries whose reason starts with ``reason``."""
    return [entry for entry in job.history if entry.reason.startswith(reason)]


def entry_to(job: Job, state: State) -> HistoryEntry:
    """The job's one history entry into ``state``."""
    found = [entry for entry in job.history if entry.dst is state]
    assert len(found) == 1, describe(job)
    return found[0]


def seconds_between(first: HistoryEntry, then: HistoryEntry) -> float:
    return (then.at - first.at).total_seconds()


def refusals(workers: Iterable[WorkerProcess]) -> Counter[str]:
    """Deliveries the gate refused, per job id, from the workers' logs."""
    return Counter(job_id for w in workers for job_id in REFUSED.findall(w.log()))


def start_together(deployment: Deployment, beats: int, worker_concurrency: int) -> list[Any]:
    """Start a worker and ``beats`` plain reconciling beats at once; wait for all of them."""
    worker = deployment.start_worker(concurrency=worker_concurrency, wait=False)
    started = [deployment.start_beat(every=0, wait=False) for _ in range(beats)]
    worker.wait_ready()
    for beat in started:
        beat.wait_ready()
    return [worker, *started]


def assert_ran_once_each(ledger: Ledger, ids: Iterable[str]) -> None:
    """Each body of ``ids`` ran exactly once, as its first attempt."""
    wanted = set(ids)
    runs = Counter((row.task_id, row.attempt) for row in ledger.rows(phase=EXECUTIONS))
    mine = {key: n for key, n in runs.items() if key[0] in wanted}
    assert mine == {(task_id, 0): 1 for task_id in wanted}, mine


def assert_never_ran(ledger: Ledger, ids: Iterable[str]) -> None:
    ran = {task_id: n for task_id in ids if (n := ledger.count(task_id=task_id))}
    assert not ran, f"bodies that must not have run ran: {ran}"


# --- 1. a beat SIGKILLed between its claim and the dispatch -----------------------------------

BATCH = 24


@pytest.mark.timeout(90)
@EVERY_STORE
def test_a_batch_left_scheduled_by_a_beat_killed_after_its_claim_is_replayed_and_runs_once(
    deployment: Deployment, ledger: Ledger, gate: None
) -> None:
    # Given a worker, a beat that reconciles, and a beat set to die after its next claim
    scale_down(deployment)
    worker = deployment.start_worker(concurrency=4, wait=False)
    reconciler = deployment.start_beat(every=0, extra_env=RECONCILER_ONLY, wait=False)
    doomed = deployment.start_beat(every=0, extra_env=dying("after_claim"), wait=False)

    # When a batch of delayed jobs falls due, and that beat claims it and is SIGKILLed
    # before its DISPATCHED write
    ids = submit_delayed(deployment, [("gated_record", ("replay", i)) for i in range(BATCH)])
    claimed = wait_killed(doomed, "after_claim")

    # Then it claimed the whole batch in one go, and left it SCHEDULED, unpublished
    assert claimed == set(ids)
    left = jobs_of(deployment, ids)
    assert all(job.state is State.SCHEDULED and job.node == doomed.node for job in left), [
        describe(job) for job in left if job.state is not State.SCHEDULED
    ][:2]
    assert ledger.count(task="gated_record") == 0

    # And the reconciler replays each job once, no sooner than replay_age after its
    # claim, and its body runs exactly once: none is left SCHEDULED
    worker.wait_ready()
    settled = wait_states(deployment, dict.fromkeys(ids, State.SUCCEEDED))
    assert_ran_once_each(ledger, ids)
    for job in settled:
        replays = entries(job, REPLAY_REASON)
        assert len(replays) == 1, describe(job)
        assert (replays[0].src, replays[0].dst) == (State.SCHEDULED, State.DISPATCHED)
        assert replays[0].node != doomed.node  # a live reconciler (see dying())
        claim = entries(job, SWEEP)
        assert len(claim) == 1 and claim[0].node == doomed.node, describe(job)
        assert seconds_between(claim[0], replays[0]) >= REPLAY_AGE, describe(job)
        assert job.dispatches == 1, describe(job)
    assert not refusals(deployment.workers), "a replayed job was delivered twice"
    assert reconciler.alive()


# --- 2. the stuck-job drill ---------------------------------------------------------------------

#: Jobs claimed with the chunk the SIGKILL leaves DISPATCHED, and left SCHEDULED behind it.
BEHIND = 4
#: The drill's dispatch_deadline: a second of margin more than :data:`FAST`'s for the
#: reconciler's passes (one a second) to redispatch the opted-in jobs, which they may
#: do from dispatch_timeout on, before they would time them out instead.
DRILL_DEADLINE = 6.0


@pytest.mark.timeout(90)
@EVERY_STORE
def test_stuck_jobs_drill_replays_the_scheduled_runs_the_opted_in_and_times_out_the_others(
    deployment: Deployment, ledger: Ledger, gate: None
) -> None:
    # Given a worker, a beat that reconciles, and a beat set to die after its next
    # DISPATCHED write
    scale_down(deployment, dispatch_deadline=DRILL_DEADLINE)
    worker = deployment.start_worker(concurrency=4, wait=False)
    reconciler = deployment.start_beat(every=0, extra_env=RECONCILER_ONLY, wait=False)
    doomed = deployment.start_beat(every=0, extra_env=dying("after_dispatched_write"), wait=False)

    # When more delayed jobs than one dispatch chunk fall due together, of a default
    # gated task and of one opted in to redispatch, and that beat claims them all and
    # is SIGKILLed right after the first chunk's DISPATCHED write, before its publishes
    ids = submit_delayed(
        deployment,
        [
            ("gated_redispatch" if i % 2 else "gated_record", ("drill", i))
            for i in range(DISPATCH_CHUNK + BEHIND)
        ],
    )
    written = wait_killed(doomed, "after_dispatched_write")

    # Then one chunk is DISPATCHED with no message, the jobs behind it SCHEDULED
    assert len(written) == DISPATCH_CHUNK and written < set(ids), written
    behind = [task_id for task_id in ids if task_id not in written]
    records = {job.ref.id: job for job in jobs_of(deployment, ids)}
    for job in records.values():
        state = State.DISPATCHED if job.ref.id in written else State.SCHEDULED
        assert job.state is state and job.node == doomed.node, describe(job)
    default = [i for i in written if records[i].task == "gated_record"]
    opted_in = [i for i in written if records[i].task == "gated_redispatch"]
    assert default and opted_in, "one chunk of the two tasks, each about half"
    assert ledger.count() == 0

    # And the reconciler replays the SCHEDULED jobs, which run once; it redispatches
    # the opted-in DISPATCHED ones after dispatch_timeout, which run once; the default
    # ones reach TIMEOUT at dispatch_deadline and never run
    worker.wait_ready()
    wait_states(
        deployment,
        {
            **dict.fromkeys(behind, State.SUCCEEDED),
            **dict.fromkeys(opted_in, State.SUCCEEDED),
            **dict.fromkeys(default, State.TIMEOUT),
        },
    )
    assert_ran_once_each(ledger, behind)
    assert_ran_once_each(ledger, opted_in)
    assert_never_ran(ledger, default)
    for job in jobs_of(deployment, behind):
        replays = entries(job, REPLAY_REASON)
        assert len(replays) == 1 and replays[0].node != doomed.node, describe(job)
        assert job.dispatches == 1, describe(job)
    for job in jobs_of(deployment, default):
        timeout = entry_to(job, State.TIMEOUT)
        assert timeout.src is State.DISPATCHED and timeout.node != doomed.node, describe(job)
        assert timeout.reason.startswith("not run within dispatch_deadline"), describe(job)
        dispatched = entry_to(job, State.DISPATCHED)
        assert seconds_between(dispatched, timeout) >= DRILL_DEADLINE, describe(job)
        assert job.dispatches == 1, describe(job)  # never republished
    for job in jobs_of(deployment, opted_in):
        again = entries(job, REDISPATCH_REASON)
        assert len(again) == 1 and again[0].node != doomed.node, describe(job)
        dead_write = entries(job, SWEEP)[-1]  # the DISPATCHED write the doomed beat made
        assert (dead_write.dst, dead_write.node) == (State.DISPATCHED, doomed.node)
        assert seconds_between(dead_write, again[0]) >= DISPATCH_TIMEOUT, describe(job)
        assert job.dispatches == 2, describe(job)
    assert not refusals(deployment.workers), "a stuck job was delivered twice"
    assert reconciler.alive()


# --- 3. two reconcilers over the same stale jobs ---------------------------------------------

CRASHED = "crashed-node"
STALE_EACH = 12


def leave_stale(deployment: Deployment) -> tuple[list[str], list[str], list[str]]:
    """Gated jobs a node left as it died inside ``apply_async``; their ids by kind.

    The test process plays that node and writes what ``ExactOnceTask.apply_async``
    writes before it publishes: the ``SCHEDULED`` create, then (for two thirds)
    the ``DISPATCHED`` CAS, and dies before the publish (the kill points of the
    beat's sweep are drilled by the tests above). Returns the ids left
    ``SCHEDULED``, ``DISPATCHED`` (default gated task), ``DISPATCHED`` (opted in).
    """
    kinds = (("s", "gated_record"), ("d", "gated_record"), ("r", "gated_redispatch"))
    news = [
        NewJob(
            JobRef.submitted(str(uuid.uuid4())),
            task,
            State.SCHEDULED,
            node=CRASHED,
            args=[kind, i],
            options={GATED_OPTION: True},
            reason="apply_async",
        )
        for kind, task in kinds
        for i in range(STALE_EACH)
    ]
    store = deployment.store()
    assert all(result.created for result in store.create_many(news))
    replies = store.transition_many(
        [
            (
                new.ref,
                Transition(
                    State.DISPATCHED,
                    frozenset({State.SCHEDULED}),
                    node=CRASHED,
                    reason="apply_async",
                    rev=new.rev,
                ),
            )
            for new in news
            if new.args[0] != "s"
        ]
    )
    assert all(reply.applied for reply in replies)
    ids = [new.ref.id for new in news]
    scheduled, default, opted_in = (ids[k * STALE_EACH : (k + 1) * STALE_EACH] for k in range(3))
    return scheduled, default, opted_in


@pytest.mark.timeout(90)
@EVERY_STORE
def test_two_reconcilers_at_once_make_each_transition_of_each_stale_job_once(
    deployment: Deployment, ledger: Ledger, gate: None
) -> None:
    # Given two beats that both reconcile every second, and a worker
    scale_down(deployment)
    worker, *beats = start_together(deployment, beats=2, worker_concurrency=4)

    # When a node dies leaving stale jobs: SCHEDULED, and DISPATCHED with no message
    # (of a default gated task, and of one opted in to redispatch)
    scheduled, default, opted_in = leave_stale(deployment)

    # Then every job reaches its end through one transition: replayed once, timed out
    # once or redispatched once; the replayed and redispatched bodies run exactly once,
    # the timed-out ones never
    settled = wait_states(
        deployment,
        {
            **dict.fromkeys(scheduled, State.SUCCEEDED),
            **dict.fromkeys(default, State.TIMEOUT),
            **dict.fromkeys(opted_in, State.SUCCEEDED),
        },
    )
    for job in settled:
        replays, redispatches = entries(job, REPLAY_REASON), entries(job, REDISPATCH_REASON)
        timeouts = [entry for entry in job.history if entry.dst is State.TIMEOUT]
        counts = (len(replays), len(redispatches), len(timeouts), job.dispatches)
        expected = {"s": (1, 0, 0, 1), "d": (0, 0, 1, 1), "r": (0, 1, 0, 2)}[job.args[0]]
        assert counts == expected, describe(job)
    assert_ran_once_each(ledger, scheduled)
    assert_ran_once_each(ledger, opted_in)
    assert_never_ran(ledger, default)
    # ... and nothing moves any more while both go on reconciling
    revs = {job.ref.id: job.rev for job in settled}
    holds(
        lambda: (
            {job.ref.id: job.rev for job in jobs_of(deployment, revs)} == revs
            and ledger.count() == 2 * STALE_EACH
        ),
        seconds=1.0,
        interval=0.25,
    )
    assert all(beat.alive() for beat in beats)
    assert not refusals([worker]), "a stale job was delivered twice"
    # ... both beats took turns at the passes (each slot's pass goes to the claim's winner)
    passes = {beat.name: len(beat.events("reconcile_pass")) for beat in beats}
    assert all(passes.values()), passes
    print(f"reconcile passes per beat: {passes}")


# --- 4. the reconciler racing a worker -------------------------------------------------------

#: Seconds the single worker process is busy before it takes the queued jobs: past
#: DISPATCH_TIMEOUT (plus a pass) so opted-in jobs are redispatched while queued, short
#: of DISPATCH_DEADLINE so some default jobs run before theirs falls. (At 3 s, the
#: dispatch timeout itself, a slow submit let the queue drain before any pass.)
BLOCK = 4.0
#: Seconds each default gated job's body takes: the queue drains across the deadline.
SLOW = 0.25
SLOW_JOBS = 16
OPTED_IN_JOBS = 6


@pytest.mark.timeout(90)
@EVERY_STORE
def test_a_reconciler_racing_a_worker_times_out_no_job_that_ran_and_runs_each_body_once(
    deployment: Deployment, ledger: Ledger, gate: None
) -> None:
    # Given a reconciling beat, and one worker process busy for a few seconds
    scale_down(deployment)
    worker, beat = start_together(deployment, beats=1, worker_concurrency=1)
    deployment.send("slow_record", BLOCK)
    ledger.wait_count(1, task="slow_record")

    # When gated jobs wait behind it in the queue past dispatch_timeout, slow default
    # ones interleaved with ones opted in to redispatch, and the worker takes them
    # while the reconciler redispatches the opted-in and times out the others
    slow, opted_in = [], []
    for i in range(SLOW_JOBS):
        slow.append(deployment.send("gated_slow", SLOW).id)
        if i < OPTED_IN_JOBS:
            opted_in.append(deployment.send("gated_redispatch", "race", i).id)

    # Then every opted-in job runs exactly once and succeeds; every default one either
    # ran once and succeeded, or never ran and timed out: no job that ran timed out
    wait_states(deployment, dict.fromkeys(opted_in, State.SUCCEEDED))
    terminal: list[Job] = poll(
        lambda: (found := jobs_of(deployment, slow)) and all(j.terminal for j in found) and found,
        timeout=SETTLE_TIMEOUT,
        interval=0.1,
    )
    assert_ran_once_each(ledger, opted_in)
    runs = ledger.executions(task="gated_slow")
    assert set(runs.values()) <= {1}, runs
    ran = {task_id for task_id, _ in runs}
    for job in terminal:
        if job.ref.id in ran:
            assert job.state is State.SUCCEEDED, describe(job)
        else:
            assert job.state is State.TIMEOUT, describe(job)
            assert entry_to(job, State.TIMEOUT).src is State.DISPATCHED, describe(job)
        assert job.dispatches == 1, describe(job)
    # ... every message is consumed: each second delivery (a redispatched job's other
    # copy, a timed-out job's only one) is refused at the gate, and none runs
    redispatched = {
        job.ref.id for job in jobs_of(deployment, opted_in) if entries(job, REDISPATCH_REASON)
    }
    timed_out = {job.ref.id for job in terminal if job.state is State.TIMEOUT}
    expected = Counter([*redispatched, *timed_out])
    try:
        poll(lambda: refusals([worker]) == expected, timeout=SETTLE_TIMEOUT, interval=0.2)
    except AssertionError:
        raise AssertionError(
            f"refused deliveries {dict(refusals([worker]))} != expected {dict(expected)}"
        ) from None
    assert ledger.count(task="gated_redispatch") == OPTED_IN_JOBS
    assert ledger.executions(task="gated_slow") == runs
    # ... and the drill did straddle both decisions: opted-in jobs were redispatched
    # while queued, and the deadline fell while the worker drained the default ones
    assert redispatched, "no opted-in job was redispatched: the queue drained too early"
    assert ran and timed_out, f"{len(ran)} default job(s) ran, {len(timed_out)} timed out"
    assert beat.alive()
    print(
        f"redispatched {len(redispatched)}/{OPTED_IN_JOBS}; default jobs ran {len(ran)}, "
        f"timed out {len(timed_out)}"
    )


# --- 5. a worker still on old code ------------------------------------------------------------

OLD_WORKER_JOBS = 6


@pytest.mark.timeout(90)
@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis",))
def test_a_worker_without_the_gate_runs_each_gated_job_once_and_nothing_redispatches_it(
    deployment: Deployment, ledger: Ledger, gate: None
) -> None:
    # Given a worker on code from before the gate, consuming a gated task's queue, and a
    # beat that reconciles (redispatch off: the default)
    scale_down(deployment)
    deployment.app()  # the sender has the gate
    deployment.extra_env[NO_GATE] = "1"
    deployment.start_worker(concurrency=2)
    del deployment.extra_env[NO_GATE]
    deployment.start_beat(every=0)
    # When gated jobs are sent
    ids = [deployment.send("gated_record", "old", i).id for i in range(OLD_WORKER_JOBS)]
    # Then each body runs once, unseen by the store (no RUNNING, no result), and the
    # reconciler times each job out at dispatch_deadline without publishing it again
    ledger.wait_count(OLD_WORKER_JOBS, task="gated_record")
    settled = wait_states(deployment, dict.fromkeys(ids, State.TIMEOUT))
    for job in settled:
        assert State.RUNNING not in {entry.dst for entry in job.history}, describe(job)
        assert entry_to(job, State.TIMEOUT).src is State.DISPATCHED, describe(job)
        assert job.dispatches == 1, describe(job)
    holds(lambda: ledger.count(task="gated_record") == OLD_WORKER_JOBS, seconds=1.0)
    assert_ran_once_each(ledger, ids)


@pytest.mark.timeout(90)
@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("postgres",))
def test_a_worker_without_the_gate_runs_each_one_write_submit_once(
    deployment: Deployment, ledger: Ledger, gate: None
) -> None:
    """Scenario 65 on the SQL stores' one-write submit (the record written DISPATCHED by
    the statement that creates it, then published): with redispatch off, once."""
    worker_without_the_gate_runs_each_one_write_submit_once(deployment, ledger)


@pytest.mark.timeout(90)
@pytest.mark.acceptance_matrix(brokers=("amqp",), stores=("redis",))
def test_a_worker_without_the_gate_runs_each_one_write_submit_on_redis_with_rabbitmq_once(
    deployment: Deployment, ledger: Ledger, gate: None
) -> None:
    """Scenario 65 on the Redis store with another broker (RabbitMQ, confirms on): the
    record written DISPATCHED by one script, then published; with redispatch off, once."""
    worker_without_the_gate_runs_each_one_write_submit_once(deployment, ledger)


def worker_without_the_gate_runs_each_one_write_submit_once(
    deployment: Deployment, ledger: Ledger
) -> None:
    # Given a worker on code from before the gate, consuming a gated task's queue, and a
    # beat that reconciles (redispatch off: the default)
    scale_down(deployment)
    deployment.app()
    deployment.extra_env[NO_GATE] = "1"
    deployment.start_worker(concurrency=2)
    del deployment.extra_env[NO_GATE]
    deployment.start_beat(every=0)
    # When gated jobs are sent, each created DISPATCHED by one statement or script
    ids = [deployment.send("gated_record", "old-sql", i).id for i in range(OLD_WORKER_JOBS)]
    for job in jobs_of(deployment, ids):
        created, dispatched = job.history[:2]
        assert (created.dst, dispatched.dst, created.at) == (
            State.SCHEDULED,
            State.DISPATCHED,
            dispatched.at,
        ), describe(job)
    # Then each body runs once, and the reconciler times each job out at dispatch_deadline
    # without publishing it again
    ledger.wait_count(OLD_WORKER_JOBS, task="gated_record")
    settled = wait_states(deployment, dict.fromkeys(ids, State.TIMEOUT))
    for job in settled:
        assert State.RUNNING not in {entry.dst for entry in job.history}, describe(job)
        assert entry_to(job, State.TIMEOUT).src is State.DISPATCHED, describe(job)
        assert job.dispatches == 1, describe(job)
    holds(lambda: ledger.count(task="gated_record") == OLD_WORKER_JOBS, seconds=1.0)
    assert_ran_once_each(ledger, ids)
