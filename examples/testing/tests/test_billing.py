"""The billing tasks, tested with the celery-exactonce plugin's fixtures only.

Each test reads the same eagerly (``pytest``) and with an in-process worker
(``pytest --exactonce-mode=worker``): ``exactonce_jobs`` waits for the jobs
it reads to settle.
"""

from __future__ import annotations

import uuid
from typing import Any

from billing import provider
from billing.tasks import FAILURES, RECEIPTS, charge, flaky_sync, send_receipt


def order() -> str:
    return f"order-{uuid.uuid4().hex[:8]}"


def test_a_charge_runs_once_and_succeeds(exactonce_jobs: Any) -> None:
    result = charge.delay(order(), 1250)
    job = exactonce_jobs.assert_ran_once(result)
    assert job.state == "SUCCEEDED"
    assert exactonce_jobs.runs(result) == 1


def test_the_body_sees_a_deterministic_key_for_its_task_id(exactonce_jobs: Any) -> None:
    order_id = order()
    expected = exactonce_jobs.key_for(order_id)  # known before the job exists
    charge.apply_async((order_id, 500), task_id=order_id)
    exactonce_jobs.assert_ran_once(order_id)
    assert exactonce_jobs.key_of(order_id) == expected
    assert provider.CHARGES[expected] == (order_id, 500)


def test_the_same_task_id_submitted_twice_is_one_job_run_once(exactonce_jobs: Any) -> None:
    order_id = order()
    charge.apply_async((order_id, 900), task_id=order_id)
    exactonce_jobs.wait(order_id)
    charge.apply_async((order_id, 900), task_id=order_id)  # a retried HTTP request, say
    exactonce_jobs.assert_ran_once(order_id)
    assert provider.CALLS.count(exactonce_jobs.key_of(order_id)) == 1


def test_two_charges_are_two_jobs_of_the_task(exactonce_jobs: Any) -> None:
    first, second = charge.delay(order(), 100), charge.delay(order(), 200)
    jobs = exactonce_jobs.wait(charge)
    assert {job.ref.id for job in jobs} == {first.id, second.id}
    assert exactonce_jobs.runs(charge) == 2
    assert {job.ref.id for job in exactonce_jobs.by_state("SUCCEEDED")} == {first.id, second.id}
    assert exactonce_jobs.key_of(first) != exactonce_jobs.key_of(second)


def test_a_retried_task_runs_once_per_attempt_with_one_key(exactonce_jobs: Any) -> None:
    order_id = order()
    FAILURES[order_id] = 2
    result = flaky_sync.apply_async((order_id,), task_id=order_id)
    exactonce_jobs.wait(result)
    job = exactonce_jobs.get(result)
    assert (job.state, job.attempt) == ("SUCCEEDED", 2)
    assert exactonce_jobs.runs(result) == 3
    assert FAILURES[order_id] == 0


def test_a_delayed_receipt_waits_for_its_time_then_is_sent_once(
    exactonce_jobs: Any, exactonce_mode: str
) -> None:
    order_id = order()
    result = send_receipt.apply_async((order_id,), countdown=3600)
    job = exactonce_jobs.get(result)
    if exactonce_mode == "worker":  # eager mode runs it at once, as Celery's eager mode does
        assert job.state == "PENDING" and order_id not in RECEIPTS
    exactonce_jobs.sweep(until=job.run_at)  # the hour passes on the frozen clock
    exactonce_jobs.assert_ran_once(result)
    assert RECEIPTS.count(order_id) == 1


def test_the_store_runs_on_the_frozen_clock(
    exactonce_store: Any, exactonce_clock: Any, exactonce_jobs: Any
) -> None:
    start = exactonce_store.now()
    assert exactonce_store.now() == start  # it stands still
    exactonce_clock.advance(minutes=5)
    assert (exactonce_store.now() - start).total_seconds() == 300
    result = charge.delay(order(), 10)
    job = exactonce_jobs.assert_ran_once(result)
    assert job.created_at == exactonce_store.now()


def test_a_direct_call_runs_the_body_without_a_job(exactonce_app: Any, exactonce_jobs: Any) -> None:
    order_id = order()
    assert charge(order_id, 75) == (order_id, 75)
    assert exactonce_jobs.all() == []
    exactonce_jobs.assert_not_run(charge)
