"""The atomic gate on the django:// store: a body's rows and its job's end commit together.

Each test hands deliveries to the gate in this thread (a second one, for the
row lock), as a worker would, on SQLite, PostgreSQL and MariaDB. The body's
effect is one row of Django's ``User`` table per run that committed.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from celery import Celery

from celery_exactonce import ExactOnceTask
from celery_exactonce.core.exceptions import ConfigurationError
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.policy import task_policy
from celery_exactonce.stores.base import StateStore
from celery_exactonce.stores.memory import InMemoryStore
from celery_exactonce.task import atomic
from celery_exactonce.task.gate import validate_gated_task
from tests.django_tests.conftest import ALIASES, MYSQL, routed
from tests.support.deliveries import deliver_to, django_store_app
from tests.support.helpers import poll
from tests.support.publishing import recording

#: How long a test waits for a thread to reach a point (polled), at most.
DEADLINE = 20.0


class Died(BaseException):
    """What a worker's death mid-body looks like from inside it (nothing after it runs)."""


@dataclass
class World:
    app: Celery
    alias: str
    store: StateStore
    #: What the body does after writing its row: "return", "raise", "die", "child", "retry",
    #: "wait".
    action: str = "return"
    sent: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    inside: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def job(self, job_id: str) -> Any:
        return self.store.get(JobRef.submitted(job_id))

    def deliver(self, index: int = 0) -> str:
        task_id, headers = self.sent[index]
        return deliver_to(self.app.tasks[headers["task"]], task_id, headers)


@pytest.fixture(params=[*ALIASES, MYSQL])
def alias(request: pytest.FixtureRequest) -> Iterator[str]:
    """The database of this test (SQLite, PostgreSQL, MariaDB), every model routed to it."""
    yield from routed(request.param)


def _child(n: int) -> int:
    return n


def _nothing() -> None:
    """A task body for the start-up checks."""


def rows(task_id: str) -> int:
    from django.contrib.auth.models import User

    return User.objects.filter(username__startswith=f"row-of-{task_id}").count()


@pytest.fixture
def world(alias: str) -> Iterator[World]:
    app, store = django_store_app("atomic-gate", alias)
    world = World(app, alias, store)

    def body(self: Any, n: int) -> str:
        from django.contrib.auth.models import User

        User.objects.create(username=f"row-of-{self.request.id}-{uuid.uuid4().hex[:6]}")
        if world.action == "raise":
            raise ValueError("the charge was declined")
        if world.action == "die":
            world.action = "return"  # the next run, after the restart, gets through
            raise Died()
        if world.action in ("child", "child then raise"):
            app.tasks["t.child"].delay(n)
            if world.action == "child then raise":
                raise ValueError("after the child")
        if world.action == "retry" and not self.request.retries:
            raise self.retry(countdown=0, max_retries=3)
        if world.action == "wait":
            world.inside.set()
            assert world.release.wait(DEADLINE)
        return "charged"

    app.task(base=ExactOnceTask, shared=False, bind=True, name="t.charge", exactonce_atomic=True)(
        body
    )
    app.task(base=ExactOnceTask, shared=False, name="t.child")(_child)

    with recording(app, world.sent):
        yield world
        world.store.drop_namespace()  # type: ignore[attr-defined]


def test_an_atomic_run_commits_its_rows_and_its_end_together(world: World) -> None:
    world.app.tasks["t.charge"].apply_async((1,), task_id="ok")
    assert world.deliver() == "ran"
    assert rows("ok") == 1
    job = world.job("ok")
    assert (job.state, job.reason) == (State.SUCCEEDED, atomic.COMMITTED)
    assert world.deliver() == "ignored"  # a duplicate of it: the job has ended
    assert rows("ok") == 1


def test_a_body_that_raises_rolls_its_rows_back_and_ends_failed(world: World) -> None:
    world.action = "raise"
    world.app.tasks["t.charge"].apply_async((1,), task_id="no")
    with pytest.raises(ValueError, match="declined"):
        world.deliver()
    assert rows("no") == 0
    job = world.job("no")
    assert job.state is State.FAILED
    assert "the charge was declined" in job.reason


def test_scenario_77_a_run_that_dies_mid_body_leaves_the_job_to_run_once_again(
    world: World,
) -> None:
    """Nothing of the dead run committed: the job is as it was, its next delivery runs it."""
    world.action = "die"
    world.app.tasks["t.charge"].apply_async((1,), task_id="died")
    with pytest.raises(Died):
        world.deliver()
    assert rows("died") == 0
    assert world.job("died").state is State.DISPATCHED  # never seen RUNNING by anyone
    assert world.deliver() == "ran"  # the redelivery (or the reconciler's redispatch)
    assert world.deliver() == "ignored"
    assert rows("died") == 1
    assert world.job("died").state is State.SUCCEEDED


def test_a_retry_rolls_the_run_back_and_its_next_attempt_commits_once(world: World) -> None:
    """``self.retry()`` in an atomic body: the first attempt's row goes, the next attempt's
    stays, once; the retry's message is published once its write committed."""
    world.action = "retry"
    world.app.tasks["t.charge"].apply_async((1,), task_id="again")
    assert world.deliver(0) == "sent_back"  # (Celery's Retry)
    assert rows("again") == 0
    job = world.job("again")
    assert (job.state, job.attempt) == (State.DISPATCHED, 1)
    assert [h["retries"] for _, h in world.sent] == [0, 1]
    assert world.deliver(1) == "ran"
    assert rows("again") == 1
    assert world.job("again").state is State.SUCCEEDED


@pytest.mark.parametrize("action", ["child", "child then raise"])
def test_scenario_78_a_child_exists_and_is_published_iff_its_parent_committed(
    world: World, action: str
) -> None:
    world.action = action
    world.app.tasks["t.charge"].apply_async((7,), task_id="parent")
    if action == "child":
        assert world.deliver() == "ran"
    else:
        with pytest.raises(ValueError, match="after the child"):
            world.deliver()
    children = [i for i, h in world.sent if h["task"] == "t.child"]
    committed = action == "child"
    assert len(children) == (1 if committed else 0)
    if committed:
        assert world.job(children[0]).state is State.DISPATCHED
    assert rows("parent") == (1 if committed else 0)


#: How a test sees a statement waiting for a row lock, per database.
LOCK_WAITS = {
    "postgres": "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
    "AND datname = current_database()",
    # (MariaDB's innodb_trx leaves out a transaction Django's atomic block began)
    "mysql": "SELECT count(*) FROM information_schema.processlist "
    "WHERE state = 'Updating' AND info LIKE 'UPDATE exactonce_jobs %'",
}


def _waiting_on_a_lock(alias: str) -> bool:
    from django.db import connections

    with connections[alias].cursor() as cursor:
        cursor.execute(LOCK_WAITS[alias])
        return int(cursor.fetchone()[0]) > 0


def test_scenario_77_a_duplicate_waits_on_the_row_lock_and_does_not_run_again(
    world: World,
) -> None:
    """The second delivery's gate waits for the first's transaction, then finds the job ended."""
    if world.alias not in LOCK_WAITS:
        pytest.skip("a row lock (SQLite's writer lock is the whole file)")
    from django.db import connections

    world.action = "wait"
    world.app.tasks["t.charge"].apply_async((1,), task_id="dup")
    verdicts: dict[str, str] = {}

    def deliver(name: str) -> None:
        try:
            verdicts[name] = world.deliver()
        finally:
            connections.close_all()

    first = threading.Thread(target=deliver, args=("first",))
    first.start()
    assert world.inside.wait(DEADLINE)
    world.action = "return"  # (were the second to run the body, it would not wait)
    second = threading.Thread(target=deliver, args=("second",))
    second.start()
    # The second's gate waits on the first's row lock (or, wrongly, it got through).
    poll(lambda: _waiting_on_a_lock(world.alias) or not second.is_alive(), timeout=DEADLINE)
    assert second.is_alive(), verdicts
    world.release.set()
    first.join(DEADLINE)
    second.join(DEADLINE)
    assert verdicts == {"first": "ran", "second": "ignored"}
    assert rows("dup") == 1


def test_atomic_is_refused_on_a_store_outside_the_body_s_database() -> None:
    app = Celery("atomic-refused", set_as_current=False)
    task = app.task(base=ExactOnceTask, shared=False, name="t.a", exactonce_atomic=True)(_nothing)
    with pytest.raises(ConfigurationError, match="django://") as refused:
        atomic.check_store(task, InMemoryStore())
    assert refused.value.setting == "exactonce_store_url"


def test_atomic_is_refused_with_reject_on_worker_lost_even_with_rerun() -> None:
    app = Celery("atomic-refused", set_as_current=False)
    task = app.task(
        base=ExactOnceTask,
        shared=False,
        name="t.b",
        exactonce_atomic=True,
        exactonce_rerun=True,
        acks_late=True,
        reject_on_worker_lost=True,
    )(_nothing)
    with pytest.raises(ConfigurationError, match="exactonce_atomic") as refused:
        validate_gated_task(task)
    assert refused.value.setting == "reject_on_worker_lost"


def test_an_atomic_task_s_jobs_are_redispatched_by_the_reconciler() -> None:
    app = Celery("atomic-policy", set_as_current=False)
    task = app.task(base=ExactOnceTask, shared=False, name="t.c", exactonce_atomic=True)(_nothing)
    assert task_policy(task) == {"atomic": True, "redispatch": True}
