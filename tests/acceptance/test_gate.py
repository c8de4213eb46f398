"""The worker gate with real ``celery worker`` processes, per (broker, store) pair.

Each test drives real workers on a Redis or RabbitMQ broker with the Redis or
PostgreSQL store, and asserts on the ledger the task bodies write and on the
store: a body runs once per attempt whatever the broker redelivers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from celery_exactonce import runtime
from celery_exactonce.core.exceptions import StoreUnavailable, SubmitAmbiguous
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.dispatch.dispatcher import Dispatcher
from celery_exactonce.dispatch.messages import message_headers
from celery_exactonce.dispatch.one_step import ENQUEUED
from celery_exactonce.dispatch.publisher import CeleryPublisher, PublishFailed
from celery_exactonce.observe import metrics
from celery_exactonce.stores.redis.store import RedisStore
from tests.acceptance.harness import Deployment, Ledger, holds, poll
from tests.acceptance.proxy import proxy_to

pytestmark = pytest.mark.usefixtures("gate")


def send_copy(deployment: Deployment, task_id: str, **header_overrides: Any) -> None:
    """Publish another copy of the job's message, as a redelivery or a double publish would."""
    job = deployment.job(task_id)
    assert job is not None
    headers = {**message_headers(job, deployment.namespace), **header_overrides}
    deployment.app().send_task(
        job.task,
        args=job.args,
        kwargs=job.kwargs,
        task_id=task_id,
        headers=headers,
        retries=headers["exactonce_attempt"],
    )


def assert_dispatch_path(deployment: Deployment, task_id: str) -> None:
    """A Redis broker on the store's Redis got the job with its record, in one step."""
    job = deployment.job(task_id)
    assert job is not None
    dispatched = [entry for entry in job.history if entry.dst is State.DISPATCHED]
    one_step = deployment.broker == "redis" and deployment.store_kind == "redis"
    assert dispatched and (ENQUEUED in dispatched[0].reason) is one_step, job.history


@pytest.mark.acceptance_matrix(brokers=("redis",))
def test_redelivery_while_running_and_after_runs_once(
    deployment: Deployment, ledger: Ledger
) -> None:
    # Given acks_late and a visibility timeout shorter than the body
    deployment.configure(acks_late=True, visibility_timeout=2)
    deployment.start_worker(concurrency=2)
    result = deployment.send("gated_slow", 5)
    # When Redis redelivers the message while the body runs
    poll(lambda: deployment.skipped_deliveries() >= 1, timeout=30)
    poll(lambda: deployment.job_state(result.id) is State.SUCCEEDED, timeout=30)
    # and a copy arrives after it finished
    send_copy(deployment, result.id)
    poll(lambda: deployment.skipped_deliveries() >= 2, timeout=30)
    # Then the body ran once and every delivery was acked
    assert ledger.count(task_id=result.id) == 1
    poll(lambda: deployment.unacked() == 0, timeout=30)
    assert_dispatch_path(deployment, result.id)


def test_two_workers_receiving_the_same_job_run_it_once(
    deployment: Deployment, ledger: Ledger
) -> None:
    deployment.configure(acks_late=True)
    deployment.start_worker(concurrency=2)
    deployment.start_worker(concurrency=2)
    result = deployment.send("gated_record", "x")
    send_copy(deployment, result.id)  # the same message twice, consumed concurrently
    poll(lambda: deployment.job_state(result.id) is State.SUCCEEDED, timeout=30)
    poll(lambda: deployment.skipped_deliveries() == 1, timeout=30)
    holds(lambda: ledger.count(task_id=result.id) == 1, seconds=1.0)
    assert_dispatch_path(deployment, result.id)


def test_worker_killed_mid_body_is_not_run_again(deployment: Deployment, ledger: Ledger) -> None:
    # Given acks_late, a body that runs long, and a worker SIGKILLed in the middle of it
    deployment.configure(acks_late=True, visibility_timeout=2)
    first = deployment.start_worker(concurrency=1)
    result = deployment.send("gated_slow", 60)
    ledger.wait_count(1, task_id=result.id, timeout=30)
    first.kill()
    # When the message is redelivered to another worker
    deployment.start_worker(concurrency=1)
    poll(lambda: deployment.skipped_deliveries() >= 1, timeout=60)
    # Then the body does not run again; the job stays RUNNING for the reconciler
    assert ledger.count(task_id=result.id) == 1
    assert deployment.job_state(result.id) is State.RUNNING
    assert_dispatch_path(deployment, result.id)


def test_same_task_id_twice_is_one_job_one_run(deployment: Deployment, ledger: Ledger) -> None:
    deployment.start_worker(concurrency=2)
    first = deployment.send("gated_record", "same", task_id="fixed-id")
    second = deployment.send("gated_record", "same", task_id="fixed-id")
    assert first.id == second.id == "fixed-id"
    poll(lambda: deployment.job_state("fixed-id") is State.SUCCEEDED, timeout=30)
    holds(lambda: ledger.count(task_id="fixed-id") == 1, seconds=1.0)


def test_retry_runs_once_per_attempt_with_a_stale_redelivery(
    deployment: Deployment, ledger: Ledger
) -> None:
    deployment.configure(acks_late=True)
    deployment.start_worker(concurrency=2)
    deployment.start_beat(every=0)  # a retry's countdown waits PENDING for beat's sweep
    result = deployment.send("gated_retry", 2, 2)
    # During the first countdown, the attempt-0 message comes again
    poll(lambda: (job := deployment.job(result.id)) is not None and job.attempt == 1)
    send_copy(deployment, result.id, exactonce_attempt=0)
    poll(lambda: deployment.job_state(result.id) is State.SUCCEEDED, timeout=60)
    rows = ledger.rows(task_id=result.id)
    assert [(row.attempt, row.kwargs["stage"]) for row in rows] == [(0, 0), (1, 1), (2, 2)]
    assert deployment.skipped_deliveries() >= 1
    job = deployment.job(result.id)
    assert job is not None and job.attempt == 2 and job.kwargs == {"stage": 2}


def test_autoretry_runs_once_per_attempt(deployment: Deployment, ledger: Ledger) -> None:
    deployment.start_worker(concurrency=2)
    deployment.start_beat(every=0)
    result = deployment.send("gated_autoretry")
    poll(lambda: deployment.job_state(result.id) is State.SUCCEEDED, timeout=60)
    assert ledger.executions() == {(result.id, 0): 1, (result.id, 1): 1, (result.id, 2): 1}


# -- faults on the sending side -------------------------------------------------------------


class FailFirstTransition:
    """The store, with its first transition write (single or batched) failing before it
    reaches the store.

    Without the one-step enqueue (where the broker shares a Redis store's
    server), whose single write has no ``DISPATCHED`` write of its own to fail.
    """

    enqueue = None

    def __init__(self, store: Any) -> None:
        self._store = store
        self.failures = 1

    def _fail_once(self) -> None:
        if self.failures:
            self.failures -= 1
            raise StoreUnavailable("injected: DISPATCHED write failed")

    def transition(self, ref: JobRef, request: Any) -> Any:
        self._fail_once()
        return self._store.transition(ref, request)

    def transition_many(self, requests: Any, **kwargs: Any) -> Any:
        self._fail_once()
        return self._store.transition_many(requests, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_failed_dispatched_write_publishes_nothing_then_once(
    deployment: Deployment, ledger: Ledger
) -> None:
    metrics.COUNTERS.reset()
    app = deployment.app()
    runtime.install(app, FailFirstTransition(deployment.store()))  # type: ignore[arg-type]
    try:
        result = deployment.send("gated_record", "w")
        # Nothing was published: the job is SCHEDULED and counted as fail-closed
        assert metrics.COUNTERS.get("fail_closed", phase="dispatched_write") == 1
        deployment.start_worker(concurrency=1)
        # the background retry publishes it once
        poll(lambda: deployment.job_state(result.id) is State.SUCCEEDED, timeout=30)
        holds(lambda: ledger.count(task_id=result.id) == 1, seconds=1.0)
        job = deployment.job(result.id)
        assert job is not None and job.dispatches == 1
    finally:
        runtime.reset(app)


def test_broker_down_rolls_back_then_runs_once(deployment: Deployment, ledger: Ledger) -> None:
    metrics.COUNTERS.reset()
    deployment.start_worker(concurrency=1)
    from tests.acceptance.apps.ledger_app import make_app

    with proxy_to(deployment.broker_url) as proxy:
        env = {**deployment.env, "EXACTONCE_ACC_BROKER_URL": proxy.url_for(deployment.broker_url)}
        app = make_app(env, set_as_current=False)
        runtime.install(app, deployment.store())
        try:
            proxy.down()
            result = app.tasks["gated_record"].apply_async(("down",))
            assert metrics.COUNTERS.get("publish_rolled_back") == 1
            assert deployment.job_state(result.id) is State.SCHEDULED
            holds(lambda: ledger.count(task_id=result.id) == 0, seconds=1.0)
            proxy.up()
            poll(lambda: deployment.job_state(result.id) is State.SUCCEEDED, timeout=60)
            holds(lambda: ledger.count(task_id=result.id) == 1, seconds=1.0)
        finally:
            runtime.reset(app)
            app.close()


@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis",))
def test_shared_redis_down_at_submit_then_resubmitted_runs_once(
    deployment: Deployment, ledger: Ledger
) -> None:
    # Given one Redis server as the store and the broker (the one-step submit), behind a proxy
    deployment.start_worker(concurrency=1)
    from tests.acceptance.apps.ledger_app import make_app

    with proxy_to(deployment.broker_url) as proxy:
        env = {**deployment.env, "EXACTONCE_ACC_BROKER_URL": proxy.url_for(deployment.broker_url)}
        app = make_app(env, set_as_current=False)
        store = RedisStore.from_url(
            proxy.url_for(deployment.store_url), namespace=deployment.namespace, retention=3600
        )
        runtime.install(app, store)
        try:
            app.tasks["gated_record"].apply_async(("up",), task_id="shared-up")
            poll(lambda: deployment.job_state("shared-up") is State.SUCCEEDED, timeout=60)
            # When the server is down at the submit: the caller is told to submit again
            proxy.down()
            with pytest.raises(SubmitAmbiguous):
                app.tasks["gated_record"].apply_async(("down",), task_id="shared-down")
            assert deployment.job_state("shared-down") is None  # nothing was written
            # Then, the server back, the same id submitted again runs once, in one step
            proxy.up()
            app.tasks["gated_record"].apply_async(("down",), task_id="shared-down")
            poll(lambda: deployment.job_state("shared-down") is State.SUCCEEDED, timeout=60)
            holds(lambda: ledger.count(task_id="shared-down") == 1, seconds=1.0)
            assert_dispatch_path(deployment, "shared-down")
        finally:
            runtime.reset(app)
            app.close()
            store.close()


class LoseFirstEnqueue:
    """The store, with its first one-write submit applied but its answer lost, and the
    read-back after it failing too: the submit cannot tell, and says so."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.lost = 0
        self.unreadable = False

    def enqueue(self, new: Any, dispatch: Any, **meanwhile: Any) -> Any:
        result = self._store.enqueue(new, dispatch, **meanwhile)
        if not self.lost:
            self.lost, self.unreadable = 1, True
            raise StoreUnavailable("injected: the answer to the enqueue was lost")
        return result

    def get(self, ref: JobRef) -> Any:
        if self.unreadable:
            self.unreadable = False
            raise StoreUnavailable("injected: the read-back failed")
        return self._store.get(ref)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


@pytest.mark.acceptance_matrix(brokers=("redis", "amqp"), stores=("postgres", "mysql"))
def test_an_ambiguous_one_write_submit_resubmitted_runs_once(
    deployment: Deployment, ledger: Ledger
) -> None:
    """Scenario 64 on the SQL stores' one-write submit: the statement wrote the record
    DISPATCHED but its answer was lost before the publish."""
    ambiguous_one_write_submit_resubmitted_runs_once(deployment, ledger)


@pytest.mark.acceptance_matrix(brokers=("amqp",), stores=("redis",))
def test_an_ambiguous_one_write_submit_on_redis_with_rabbitmq_resubmitted_runs_once(
    deployment: Deployment, ledger: Ledger
) -> None:
    """Scenario 64 on the Redis store with another broker (RabbitMQ, confirms on): its script
    wrote the record DISPATCHED, the message built meanwhile, but the answer was lost before
    the publish."""
    ambiguous_one_write_submit_resubmitted_runs_once(deployment, ledger)


def ambiguous_one_write_submit_resubmitted_runs_once(
    deployment: Deployment, ledger: Ledger
) -> None:
    app = deployment.app()
    store = LoseFirstEnqueue(deployment.store())
    runtime.install(app, store)  # type: ignore[arg-type]
    try:
        deployment.start_worker(concurrency=2)
        # When the submit's one write applies, but neither its answer nor a read-back comes
        with pytest.raises(SubmitAmbiguous) as raised:
            deployment.send("gated_record", "amb", task_id="one-write-amb")
        assert raised.value.task_id == "one-write-amb"
        # Then the record is DISPATCHED with no message (nothing was published)
        assert deployment.job_state("one-write-amb") is State.DISPATCHED
        holds(lambda: ledger.count(task_id="one-write-amb") == 0, seconds=1.0)
        # When the caller submits the same id again, it is published again, and runs once
        again = deployment.send("gated_record", "amb", task_id="one-write-amb")
        assert again.id == "one-write-amb"
        poll(lambda: deployment.job_state("one-write-amb") is State.SUCCEEDED, timeout=30)
        holds(lambda: ledger.count(task_id="one-write-amb") == 1, seconds=1.0)
        job = deployment.job("one-write-amb")
        assert job is not None and job.dispatches == 2
        created, first, again_entry = job.history[:3]
        assert (created.dst, first.dst, again_entry.dst) == (State.SCHEDULED,) + (
            State.DISPATCHED,
        ) * 2
        assert created.at == first.at  # one statement wrote both
    finally:
        runtime.reset(app)


class LandThenFail:
    """Publishes (twice: the message and a copy), then reports an error: ambiguous."""

    def __init__(self, app: Any) -> None:
        self.real = CeleryPublisher(app)

    def __call__(self, job: Job, headers: Mapping[str, Any], extra: Mapping[str, Any]) -> None:
        self.real(job, headers, extra)
        self.real(job, headers, extra)
        raise PublishFailed("injected: connection reset after the broker stored it", definite=False)


def test_ambiguous_publish_runs_once(deployment: Deployment, ledger: Ledger) -> None:
    metrics.COUNTERS.reset()
    app = deployment.app()
    rt = runtime.install(app, deployment.store())
    rt.dispatcher = Dispatcher(rt.store, LandThenFail(app), node="test")
    try:
        deployment.start_worker(concurrency=2)
        result = deployment.send("gated_record", "amb")
        assert metrics.COUNTERS.get("publish_ambiguous") == 1
        poll(lambda: deployment.job_state(result.id) is State.SUCCEEDED, timeout=30)
        poll(lambda: deployment.skipped_deliveries() == 1, timeout=30)
        assert ledger.count(task_id=result.id) == 1
    finally:
        runtime.reset(app)


def test_store_unreachable_at_the_gate_runs_once_when_it_returns(
    deployment: Deployment, ledger: Ledger
) -> None:
    deployment.app()  # the sender reaches the store directly; the worker through the proxy
    with proxy_to(deployment.store_url) as proxy:
        deployment.extra_env["EXACTONCE_ACC_STORE_URL"] = proxy.url_for(deployment.store_url)
        worker = deployment.start_worker(concurrency=1)
        proxy.down()
        result = deployment.send("gated_record", "gate")
        # The worker has the message but cannot pass the gate: the body does not run
        holds(lambda: ledger.count(task_id=result.id) == 0, seconds=3.0)
        assert worker.alive()
        assert deployment.job_state(result.id) is State.DISPATCHED
        proxy.up()
        poll(lambda: deployment.job_state(result.id) is State.SUCCEEDED, timeout=60)
        holds(lambda: ledger.count(task_id=result.id) == 1, seconds=1.0)


@pytest.mark.acceptance_matrix(brokers=("redis",))
def test_expired_message_ends_cancelled_and_is_not_run(
    deployment: Deployment, ledger: Ledger
) -> None:
    """On Redis the worker drops the expired message and the job ends ``CANCELLED``.

    On RabbitMQ Celery also sets the message's ``expiration``: the broker drops
    it and no worker ever sees it, so the job stays ``DISPATCHED`` until the
    reconciler times it out at its deadline (the reconciler's tests cover that).
    """
    # Given a job whose message expires before any worker takes it
    result = deployment.send("gated_record", "late", expires=1)
    poll(lambda: deployment.job_state(result.id) is State.DISPATCHED)
    poll(lambda: (job := deployment.job(result.id)) is not None and job.deadline is not None)
    job = deployment.job(result.id)
    assert job is not None and job.deadline is not None
    poll(lambda: deployment.store().now() > job.deadline, timeout=10)
    # When a worker receives it
    deployment.start_worker(concurrency=1)
    # Then Celery drops it as expired, the job ends CANCELLED, and nothing runs
    poll(lambda: deployment.job_state(result.id) is State.CANCELLED, timeout=30)
    holds(lambda: ledger.count(task_id=result.id) == 0, seconds=1.0)


@pytest.mark.acceptance_matrix(brokers=("redis", "amqp"), stores=("redis",))
def test_prefork_many_jobs_each_delivered_twice_run_once_each(
    deployment: Deployment, ledger: Ledger
) -> None:
    # Given 1,000 gated jobs, each published twice, and a prefork worker with 4 children
    jobs = 1000
    results = [deployment.send("gated_record", i) for i in range(jobs)]
    for result in results:
        send_copy(deployment, result.id)
    deployment.start_worker(concurrency=4)
    # When every copy has been consumed
    poll(lambda: deployment.skipped_deliveries() == jobs, timeout=150)
    # Then each body ran exactly once
    executions = ledger.executions(task="gated_record")
    assert len(executions) == jobs
    assert set(executions.values()) == {1}
