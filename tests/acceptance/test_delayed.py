"""Delayed jobs with real ``celery worker`` and ``celery beat -S exactonce`` processes.

On every store, with a Redis broker. An ``ExactOnceTask`` called with a future
``eta``/``countdown`` is stored ``PENDING`` with its ``run_at`` (no ETA message
goes to the broker); the beat nodes sweep the due ones (``PENDING →
SCHEDULED → DISPATCHED``) and ``celery_exactonce.cancel`` stops one that has
not been dispatched yet. The tests assert on the ledger the task bodies write,
on the store's records and on the messages in the broker's queue.

Three beats sweeping 10,000 due jobs runs on Redis by default, and on the SQL
stores too under ``-m slow`` (``tox -e chaos``): their part of it, 10,000 due
jobs claimed by three processes each once, is the contract suite's on every
store (tests/contract/test_concurrency.py), and this file's other tests sweep
on every store by default.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from datetime import timedelta

import pytest

import celery_exactonce
from celery_exactonce.core import jobs
from celery_exactonce.core.exceptions import JobConflict
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from tests.acceptance.harness import BeatProcess, Deployment, Ledger, holds, poll

pytestmark = [
    pytest.mark.usefixtures("gate"),
    pytest.mark.acceptance_matrix(
        brokers=("redis",), stores=("redis", "postgres", "mysql", "sqlite")
    ),
]

#: What the gate logs when it skips a delivery (``ExactOnceTask._refuse``).

#: Beat sweeps every ``exactonce_tick_interval`` (1 s by default): "a few ticks".
TICKS = 2.5


def path_of(job: Job) -> list[State]:
    """The states the job went through, from its history."""
    return [entry.dst for entry in job.history]


def new_task_id(what: str) -> str:
    return f"{what}-{uuid.uuid4().hex[:12]}"


def start_worker_and_sweeper(deployment: Deployment) -> None:
    """A worker and a beat node that only sweeps delayed jobs, started side by side."""
    worker = deployment.start_worker(concurrency=2, wait=False)
    beat = deployment.start_beat(every=0, wait=False)
    worker.wait_ready()
    beat.wait_ready()


# -- 1. a countdown longer than the visibility timeout ------------------------------------

VISIBILITY_TIMEOUT = 2
#: Longer than the visibility timeout plus the 1 s unacked sweep: the plain ETA message
#: is restored and delivered again before it is due.
COUNTDOWN = 4


@pytest.mark.timeout(60)
def test_a_countdown_past_the_visibility_timeout_runs_gated_once_and_plain_twice(
    deployment: Deployment, ledger: Ledger
) -> None:
    # Given a Redis broker whose visibility timeout is shorter than the countdown,
    # one worker and one beat node that only sweeps delayed jobs
    deployment.configure(visibility_timeout=VISIBILITY_TIMEOUT)
    start_worker_and_sweeper(deployment)

    # When a plain task and a gated task are sent with the same countdown
    plain = deployment.send("plain_record", "plain", countdown=COUNTDOWN)
    gated = deployment.send("gated_record", "gated", countdown=COUNTDOWN)
    pending = deployment.job(gated.id)
    assert pending is not None and pending.state is State.PENDING and pending.run_at is not None

    # Then the plain task's ETA message, held unacked by the worker past the visibility
    # timeout, is restored and delivered again: its body runs twice (kombu issue 337)
    ledger.wait_count(2, task_id=plain.id, timeout=30)
    # ... while the gated task's body runs once, not before its run_at
    runs = ledger.wait_count(1, task_id=gated.id, timeout=30)
    assert len(runs) == 1, runs
    assert runs[0].at >= pending.run_at.timestamp(), (runs[0].at, pending.run_at)
    holds(lambda: ledger.count(task_id=gated.id) == 1, seconds=1.0)
    poll(lambda: deployment.job_state(gated.id) is State.SUCCEEDED, timeout=10)
    print(f"plain body runs: {ledger.count(task_id=plain.id)}; gated: 1")
    # ... because no second copy of it ever existed (the gate had nothing to skip): it
    # waited in the store and was published once, when due
    assert deployment.skipped_deliveries() == 0
    job = deployment.job(gated.id)
    assert job is not None and job.dispatches == 1
    assert path_of(job) == [
        State.PENDING,
        State.SCHEDULED,
        State.DISPATCHED,
        State.RUNNING,
        State.SUCCEEDED,
    ]


# -- 2. three beat nodes sweeping 10,000 due jobs --------------------------------------------

SWEPT_JOBS = 10_000
#: Rows per ``create_many`` call when seeding the Redis store (as beat's CLAIM_BATCH).
SEED_BATCH = 500


def submitted_template(deployment: Deployment) -> Job:
    """A delayed job as ``ExactOnceTask.apply_async`` stores it: submitted, read, cancelled.

    The seeded jobs copy its task, options, node, deadline and reason, so they are
    what ``apply_async(countdown=…)`` writes whatever it writes. It is cancelled at
    once (an hour before its ``run_at``) and takes no part in the sweep.
    """
    result = deployment.send("gated_record", "template", countdown=3600)
    template = deployment.job(result.id)
    assert template is not None and template.state is State.PENDING, template
    assert celery_exactonce.cancel(result.id, app=deployment.app())
    return template


def seed(deployment: Deployment, news: Sequence[NewJob]) -> None:
    """Create ``news`` in the deployment's store, fast.

    Redis: ``create_many`` in batches. SQL stores: ``create_many`` runs about three
    statements per job (PostgreSQL here: 45 s for 10,000), so the rows its create
    writes for a non-occurrence job (``job_from_new`` laid out by
    ``sql_rows.job_values``, one row in the jobs table and nothing else) are
    inserted in one statement. The caller checks the store reads them back as the
    jobs ``create`` would have made.
    """
    store = deployment.store()
    engine, tables = getattr(store, "_engine", None), getattr(store, "_t", None)
    if engine is None or tables is None:
        for start in range(0, len(news), SEED_BATCH):
            results = store.create_many(news[start : start + SEED_BATCH], brief=True)
            assert all(result.created for result in results), "seed: a job existed already"
        return
    from celery_exactonce.stores.sql import rows as sql_rows

    now = store.now()
    rows = [
        sql_rows.job_values(jobs.job_from_new(new, now), store.namespace, store.retention)
        for new in news
    ]
    with engine.begin() as conn:
        conn.execute(tables.jobs.insert(), rows)


def queued_task_ids(deployment: Deployment) -> list[str]:
    """The task id of every message waiting in the deployment's Redis queue."""
    import redis

    client = redis.Redis.from_url(deployment.broker_url)
    try:
        raw = client.lrange(f"{deployment.redis_prefix}{deployment.queue}", 0, -1)
    finally:
        client.close()
    return [json.loads(message)["headers"]["id"] for message in raw]


def seeded_left(deployment: Deployment, ids: set[str], beats: Sequence[BeatProcess]) -> bool:
    """Whether any seeded job is still ``PENDING`` or ``SCHEDULED``; fails if a beat died."""
    for beat in beats:
        if not beat.alive():
            raise AssertionError(f"{beat!r} exited; log:\n{beat.log_tail()}")
    store = deployment.store()
    return any(
        job.ref.id in ids
        for state in (State.PENDING, State.SCHEDULED)
        for job in store.list_stale(state, 0, 10)  # beat's own occurrences may show too
    )


@pytest.mark.timeout(170)
@pytest.mark.acceptance_matrix(
    brokers=("redis",),
    stores=("redis", "postgres", "mysql", "sqlite"),
    slow_stores=("postgres", "mysql", "sqlite"),
)
def test_three_beat_nodes_sweeping_ten_thousand_due_jobs_dispatch_each_exactly_once(
    deployment: Deployment,
) -> None:
    # Given 10,000 delayed jobs that are already due, stored as apply_async stores them
    began = time.monotonic()
    template = submitted_template(deployment)
    store = deployment.store()
    due = store.now() - timedelta(minutes=1)
    news = [
        NewJob(
            JobRef.submitted(f"swept-{index:05d}"),
            template.task,
            State.PENDING,
            node=template.node,
            args=[index],
            kwargs={},
            options=template.options,
            deadline=template.deadline,
            run_at=due + timedelta(microseconds=index),
            reason=template.reason,
        )
        for index in range(SWEPT_JOBS)
    ]
    seed(deployment, news)
    seeded = time.monotonic()
    ids = {new.ref.id for new in news}
    first = store.get(news[0].ref)
    assert first is not None
    assert (first.state, first.task, first.options, first.run_at, first.rev) == (
        State.PENDING,
        template.task,
        template.options,
        news[0].run_at,
        news[0].rev,
    )
    assert {job.ref.id for job in store.list_stale(State.PENDING, 0, SWEPT_JOBS + 1)} == ids

    # When three beat nodes that only sweep delayed jobs start together
    beats = [deployment.start_beat(every=0, wait=False) for _ in range(3)]
    for beat in beats:
        beat.wait_ready()
    started = time.monotonic()
    poll(lambda: not seeded_left(deployment, ids, beats), timeout=140, interval=0.5)
    swept = time.monotonic()

    # Then the store shows every job claimed once and dispatched once
    dispatched = [
        job for job in store.list_stale(State.DISPATCHED, 0, 2 * SWEPT_JOBS) if job.ref.id in ids
    ]
    assert {job.ref.id for job in dispatched} == ids
    assert len(dispatched) == SWEPT_JOBS
    twice = [job for job in dispatched if job.dispatches != 1 or job.attempt != 0]
    assert not twice, f"{len(twice)} job(s) dispatched other than once: {twice[:2]}"
    bad_path = [
        job
        for job in dispatched
        if path_of(job) != [State.PENDING, State.SCHEDULED, State.DISPATCHED]
    ]
    assert not bad_path, f"{len(bad_path)} job(s) took another path: {bad_path[:2]}"
    # ... the broker holds exactly one message per job
    queued = queued_task_ids(deployment)
    assert len(queued) == SWEPT_JOBS, f"{len(queued)} messages queued for {SWEPT_JOBS} jobs"
    assert set(queued) == ids
    # ... and the nodes shared the work: each job was claimed and dispatched by one beat
    nodes = {beat.node for beat in beats}
    split = Counter[str]()
    for job in dispatched:
        claimer, dispatcher = job.history[1].node, job.history[2].node
        assert claimer == dispatcher and dispatcher in nodes, (job.ref, job.history)
        split[dispatcher] += 1
    print(
        f"{deployment.store_kind}: seeded in {seeded - began:.1f} s, beats ready "
        f"{started - seeded:.1f} s later, swept in {swept - started:.1f} s "
        f"({SWEPT_JOBS / (swept - started):.0f} jobs/s); dispatched per node: {dict(split)}"
    )
    assert len(split) > 1, f"one node dispatched everything: {dict(split)}"


# -- 3. cancel before run_at ------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_delayed_job_cancelled_before_its_run_at_never_runs(
    deployment: Deployment, ledger: Ledger
) -> None:
    # Given a worker, a sweeping beat node and a delayed gated job
    start_worker_and_sweeper(deployment)
    victim = deployment.send("gated_record", "cancelled", countdown=2)
    # ... and, due just after it, another one nobody cancels
    control = deployment.send("gated_record", "control", countdown=2)
    assert deployment.job_state(victim.id) is State.PENDING

    # When the first is cancelled before its run_at
    assert celery_exactonce.cancel(victim.id, app=deployment.app()) is True

    # Then the store shows it CANCELLED at once
    assert deployment.job_state(victim.id) is State.CANCELLED
    # ... the sweep passes its run_at (the later job runs) and a few ticks more
    ledger.wait_count(1, task_id=control.id, timeout=30)
    holds(lambda: ledger.count(task_id=victim.id) == 0, seconds=TICKS)
    # ... and it never ran, was never dispatched, and stays CANCELLED
    job = deployment.job(victim.id)
    assert job is not None and job.dispatches == 0
    assert path_of(job) == [State.PENDING, State.CANCELLED]
    assert job.reason == "cancelled by cancel()"
    # And cancelling a job that has already been dispatched changes nothing
    poll(lambda: deployment.job_state(control.id) is State.SUCCEEDED, timeout=10)
    assert celery_exactonce.cancel(control.id, app=deployment.app()) is False
    assert deployment.job_state(control.id) is State.SUCCEEDED
    assert ledger.count(task_id=control.id) == 1


# -- 4. re-enqueue of a task_id that already fired --------------------------------------------


@pytest.mark.timeout(60)
def test_resubmitting_a_fired_delayed_task_id_does_not_run_it_again(
    deployment: Deployment, ledger: Ledger
) -> None:
    # Given a delayed gated job that has run
    start_worker_and_sweeper(deployment)
    task_id = new_task_id("fired")
    first = deployment.send("gated_record", "report", 42, task_id=task_id, countdown=1)
    assert first.id == task_id
    ledger.wait_count(1, task_id=task_id, timeout=30)
    poll(lambda: deployment.job_state(task_id) is State.SUCCEEDED, timeout=10)
    fired = deployment.job(task_id)
    assert fired is not None

    # When the same task_id is sent again with the same payload, delayed and at once
    again = deployment.send("gated_record", "report", 42, task_id=task_id, countdown=1)
    now = deployment.send("gated_record", "report", 42, task_id=task_id)

    # Then both return the existing job, which does not run again (past the new
    # run_at and a few ticks of the sweep)
    assert again.id == now.id == task_id
    holds(lambda: ledger.count(task_id=task_id) == 1, seconds=1 + TICKS)
    assert deployment.job(task_id) == fired  # not a write since it ran

    # When it is sent again with another payload
    # Then that is refused with JobConflict naming the task_id, and nothing changes
    conflict = f"task_id {re.escape(repr(task_id))} already exists as gated_record with another"
    with pytest.raises(JobConflict, match=conflict):
        deployment.send("gated_record", "report", 43, task_id=task_id, countdown=1)
    with pytest.raises(JobConflict, match=conflict):
        deployment.send("gated_record", "report", 42, task_id=task_id, kwargs={"extra": True})
    assert deployment.job(task_id) == fired
    holds(lambda: ledger.count(task_id=task_id) == 1, seconds=0.5)
    assert deployment.skipped_deliveries() == 0  # nothing was even published again
