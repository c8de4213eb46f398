"""A body's own ``transaction.atomic()`` on the django:// store: its retry, requeue, replacement.

The gate's writes about the running job's future (the next attempt of a
``self.retry()`` or a ``Reject(requeue=True)``, the replacement of a
``self.replace()``) and their messages commit together or not at all, whatever
the body's block does: the block rolls back (the exception leaves it), its own
rows go, and the job still moves on. Each test hands one delivery to the gate
in this thread, on the very Django connection the body's block holds, on
SQLite and on PostgreSQL. (The same through a real worker:
tests/acceptance/test_django_atomic.py.)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Reject

from celery_exactonce import ExactOnceTask
from celery_exactonce.core.exceptions import StoreUnavailable
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.dispatch.messages import HEADER_ATTEMPT, replacement_job_id
from celery_exactonce.stores.base import StateStore
from tests.support.deliveries import deliver_to, django_store_app
from tests.support.publishing import recording


@dataclass
class World:
    app: Celery
    alias: str
    store: StateStore
    #: What the body does inside its block on its first attempt.
    action: str = "retry"
    sent: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    runs: list[tuple[str, int]] = field(default_factory=list)

    def job(self, job_id: str) -> Any:
        return self.store.get(JobRef.submitted(job_id))

    def deliver(self, index: int) -> str:
        """Hand the gate the ``index``-th message published, as a worker would."""
        task_id, headers = self.sent[index]
        return deliver_to(self.app.tasks[headers["task"]], task_id, headers)


@pytest.fixture
def world(alias: str) -> Iterator[World]:
    app, store = django_store_app("atomic-future", alias)
    world = World(app, alias, store)

    def body(self: Any, n: int) -> None:
        from django.contrib.auth.models import User
        from django.db import transaction

        attempt = int(self.request.retries or 0)
        world.runs.append((self.request.id, attempt))
        if attempt > 0 or self.name != "t.body":
            return
        with transaction.atomic(using=world.alias):
            User.objects.create(username=f"row-of-{self.request.id}")
            if world.action == "retry":
                raise self.retry(countdown=0, max_retries=3)
            if world.action == "replace":
                self.replace(app.tasks["t.after"].s(n))
            raise Reject("not now", requeue=True)

    app.task(base=ExactOnceTask, shared=False, bind=True, name="t.body", acks_late=True)(body)
    app.task(base=ExactOnceTask, shared=False, bind=True, name="t.after")(body)

    with recording(app, world.sent):
        yield world
        world.store.drop_namespace()  # type: ignore[attr-defined]


def _no_row(task_id: str) -> bool:
    from django.contrib.auth.models import User

    return not User.objects.filter(username=f"row-of-{task_id}").exists()


@pytest.mark.parametrize("action", ["retry", "requeue"])
def test_scenario_76_a_retry_or_requeue_inside_the_bodys_atomic_runs_the_next_attempt(
    world: World, action: str
) -> None:
    """The block rolls back; the next attempt is written, published, and runs once.

    Before the fix, ``self.retry()`` wrote the next attempt inside the body's
    block and published it at once; the ``Retry`` leaving the block rolled the
    write back, so the job stayed ``RUNNING`` at attempt 0 and the gate refused
    the attempt-1 message as stale (the job ended ``TIMEOUT`` much later).
    (``Reject(requeue=True)`` is handled once the block has ended: it already
    moved on, and stays so.)
    """
    world.action = action
    world.app.tasks["t.body"].apply_async((1,), task_id="j")
    assert world.deliver(0) == ("sent_back" if action == "retry" else "ignored")
    assert _no_row("j")  # the body's block did roll back
    job = world.job("j")
    assert (job.state, job.attempt) == (State.DISPATCHED, 1)
    assert [(i, h[HEADER_ATTEMPT]) for i, h in world.sent] == [("j", 0), ("j", 1)]
    assert world.deliver(1) == "ran"
    assert world.runs == [("j", 0), ("j", 1)]
    assert world.job("j").state is State.SUCCEEDED


def test_scenario_76_a_replace_inside_the_bodys_atomic_submits_a_replacement_that_exists(
    world: World,
) -> None:
    """The block rolls back; the replacement is written, published, and runs.

    Before the fix, the replacement's record and its on-commit publish were
    made inside the body's block and rolled back with it when ``replace()``
    raised ``Ignore``: nothing was published, yet the gate ended the job
    ``SUCCEEDED`` "replaced by" a job that did not exist.
    """
    world.action = "replace"
    world.app.tasks["t.body"].apply_async((1,), task_id="r")
    assert world.deliver(0) == "ignored"
    assert _no_row("r")
    replacement = replacement_job_id("r", 1)
    ended = world.job("r")
    assert ended.state is State.SUCCEEDED and replacement in ended.reason
    assert world.job(replacement).state is State.DISPATCHED
    assert [(i, h["task"]) for i, h in world.sent] == [("r", "t.body"), ("r", "t.after")]
    assert world.deliver(1) == "ran"
    assert world.job(replacement).state is State.SUCCEEDED


def test_scenario_76_a_submit_of_another_job_inside_the_bodys_atomic_stays_transactional(
    world: World,
) -> None:
    """Another job the body submits in its block is still the block's: rolled back with it."""
    world.action = "retry"

    def submit_then_retry(self: Any, n: int) -> None:
        from django.db import transaction

        if self.request.retries:
            return
        with transaction.atomic(using=world.alias):
            world.app.tasks["t.after"].apply_async((2,), task_id="child")
            raise self.retry(countdown=0, max_retries=3)

    world.app.task(base=ExactOnceTask, shared=False, bind=True, name="t.parent")(submit_then_retry)
    world.app.tasks["t.parent"].apply_async((1,), task_id="p")
    task_id, headers = world.sent[0]
    assert deliver_to(world.app.tasks["t.parent"], task_id, headers) == "sent_back"
    assert world.job("child") is None  # rolled back with the block, never published
    assert [i for i, _ in world.sent] == ["p", "p"]
    assert world.job("p").attempt == 1


def test_scenario_76_a_retry_whose_write_fails_after_the_block_publishes_nothing_and_fails(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next attempt cannot be written: no message for it, and the job ends ``FAILED``.

    The write now waits for the body to end: this is its failure, loud (the
    ``Reject`` Celery's retry raises when it cannot publish), never a message
    without its write. (Before the fix the same write failed inside the block,
    with the same outcome: this guards the new path, it does not reproduce the
    old bug.)
    """
    write = world.store.transition

    def refuse_next_attempt(ref: JobRef, request: Any, **kw: Any) -> Any:
        if request.next_attempt:
            raise StoreUnavailable("the store is down for the next attempt")
        return write(ref, request, **kw)

    monkeypatch.setattr(world.store, "transition", refuse_next_attempt)
    world.app.tasks["t.body"].apply_async((1,), task_id="f")
    assert world.deliver(0) == "requeued"  # Reject(requeue=False), as Celery's retry raises
    assert _no_row("f")
    job = world.job("f")
    assert (job.state, job.attempt) == (State.FAILED, 0)
    assert "rejected" in job.reason
    assert [i for i, _ in world.sent] == ["f"]  # nothing published for attempt 1
