"""The harness itself, with plain Celery tasks: it runs real workers, and the problem is real.

These are the baselines the gate's acceptance tests are measured against: without
the gate a redelivered message runs its body again.
"""

from __future__ import annotations

import pytest

from tests.acceptance.harness import Deployment, Ledger, holds, poll

# The store plays no part in a plain task: one store is enough for these.
plain_matrix = pytest.mark.acceptance_matrix(stores=("redis",))


@plain_matrix
def test_plain_task_sent_once_runs_once(deployment: Deployment, ledger: Ledger) -> None:
    worker = deployment.start_worker(concurrency=1)
    result = deployment.send("plain_record", "a", 1, kwargs={"k": "ü"})

    [row] = ledger.wait_count(1, task_id=result.id)
    assert (row.task, row.attempt, row.phase) == ("plain_record", 0, "run")
    assert (row.args, row.kwargs) == (["a", 1], {"k": "ü"})
    assert worker.owns(row.pid) and row.pid != worker.pid  # a pool child ran it
    # Nothing else runs it: the worker takes the next message, and the first is not repeated.
    follow = deployment.send("plain_record", "b")
    ledger.wait_count(1, task_id=follow.id)
    holds(lambda: ledger.count() == 2, seconds=1.0)
    assert ledger.executions() == {(result.id, 0): 1, (follow.id, 0): 1}
    assert worker.terminate() == 0  # an idle worker's warm shutdown is clean
    assert not worker.alive()


@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis",))
def test_purge_drops_the_waiting_messages(deployment: Deployment, ledger: Ledger) -> None:
    dropped = [deployment.send("plain_record", n) for n in range(3)]
    assert deployment.purge() == 3
    deployment.start_worker(concurrency=1)
    kept = deployment.send("plain_record", "kept")
    ledger.wait_count(1, task_id=kept.id)
    holds(lambda: ledger.count() == 1, seconds=1.0)
    assert all(ledger.count(task_id=result.id) == 0 for result in dropped)


@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis",))
def test_redis_visibility_timeout_runs_a_plain_body_twice(
    deployment: Deployment, ledger: Ledger
) -> None:
    """Without the gate, Redis redelivers a running ``acks_late`` message: the body runs twice.

    What makes kombu 5.7's Redis transport redeliver reliably:
    ``task_acks_late=True``, ``broker_transport_options`` ``visibility_timeout=2``
    plus ``unacked_restore_interval=1`` and ``unacked_restore_throttle=1`` (the
    worker's sweep of the ``unacked`` index otherwise runs only every 10 x 10 s),
    ``worker_prefetch_multiplier=1`` and ``-c 2``: the restored message is fetched
    while the first delivery still runs (prefetch limit 2), by the idle pool
    child. The same worker restores its own in-flight message: no second
    worker is needed.
    """
    deployment.configure(acks_late=True, visibility_timeout=2)
    worker = deployment.start_worker(concurrency=2)
    result = deployment.send("slow_record", 5)

    first, second = ledger.wait_count(2, timeout=20, task_id=result.id)[:2]
    assert (first.attempt, second.attempt) == (0, 0)  # the same delivery, not a retry
    assert first.pid != second.pid and worker.owns(first.pid) and worker.owns(second.pid)
    # Redelivered while the first run was still in its body.
    assert not [r for r in ledger.rows(task_id=result.id, phase="end") if r.at < second.at]
    assert second.at - first.at > 1.5  # not before the visibility timeout (2 s)


@pytest.mark.acceptance_matrix(stores=("redis",))
def test_sigkilled_worker_mid_body_redelivers_to_a_new_worker(
    deployment: Deployment, ledger: Ledger
) -> None:
    """``acks_late`` and the whole worker SIGKILLed inside the body: a new worker runs it again.

    RabbitMQ requeues the unacked message when the dead worker's connection
    closes; Redis leaves it in the ``unacked`` index until a live worker's sweep
    finds it older than ``visibility_timeout`` (3 s here, longer than the body so
    the new worker's own run is not redelivered as well).
    """
    deployment.configure(acks_late=True, visibility_timeout=3)
    first_worker = deployment.start_worker(concurrency=1)
    result = deployment.send("slow_record", 1.5)

    [started] = ledger.wait_count(1, task_id=result.id)
    assert first_worker.owns(started.pid)
    first_worker.kill()
    assert not first_worker.alive()
    assert ledger.rows(task_id=result.id, phase="end") == []

    second_worker = deployment.start_worker(concurrency=1)
    ended = ledger.wait_count(1, timeout=30, task_id=result.id, phase="end")
    again = ledger.rows(task_id=result.id, phase="start")
    assert len(again) == 2, again
    assert again[1].pid != started.pid and again[1].attempt == 0
    assert ended[0].pid == again[1].pid
    assert not first_worker.owns(started.pid)  # that child died with its worker
    assert second_worker.alive()


@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis",))
def test_killing_the_pool_child_loses_the_message_with_celery_defaults(
    deployment: Deployment, ledger: Ledger
) -> None:
    """SIGKILL of the pool child only: ``WorkerLostError``, and the message is acked.

    With ``task_reject_on_worker_lost`` off (Celery's default) ``acks_late`` does
    not bring the message back: the body is not run again. The visibility
    timeout is left at kombu's default (1 h) so that only the kill path is seen.
    """
    deployment.configure(acks_late=True)
    worker = deployment.start_worker(concurrency=1)
    result = deployment.send("slow_record", 30)

    [started] = ledger.wait_count(1, task_id=result.id)
    assert deployment.unacked() == 1  # delivered, in the body, not acked (acks_late)
    killed = worker.kill_child_in_body(ledger, result.id)
    assert killed == started.pid
    poll(worker.saw_worker_lost, timeout=15)
    poll(lambda: deployment.unacked() == 0, timeout=10)  # acked, not requeued
    assert worker.alive()
    follow = deployment.send("plain_record", "after")
    ledger.wait_count(1, task_id=follow.id)  # a new child took the next message
    assert [(r.phase, r.pid) for r in ledger.rows(task_id=result.id)] == [("start", killed)]
    assert deployment.purge() == 0
