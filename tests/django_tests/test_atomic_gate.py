"""The atomic gate on the django:// store: a body's rows and its job's end commit together.

Each test hands deliveries to the gate in this thread (a second one, for the
row lock), as a worker would, on SQLite, PostgreSQL and MariaDB. The body's
effect is one row of Django's ``User`` table per run that committed.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_exactonce import ExactOnceTask
from celery_exactonce.core.exceptions import ConfigurationError
from celery_exactonce.core.states import State
from celery_exactonce.policy import task_policy
from celery_exactonce.stores.memory import InMemoryStore
from celery_exactonce.task import atomic
from celery_exactonce.task.gate import validate_gated_task
from tests.django_tests.conftest import ALIASES, MYSQL, routed
from tests.support import atomic_runs
from tests.support.atomic_runs import LOCK_WAITS, World
from tests.support.deliveries import django_store_app
from tests.support.publishing import recording


@pytest.fixture(params=[*ALIASES, MYSQL])
def alias(request: pytest.FixtureRequest) -> Iterator[str]:
    """The database of this test (SQLite, PostgreSQL, MariaDB), every model routed to it."""
    yield from routed(request.param)


def _nothing() -> None:
    """A task body for the start-up checks."""


def rows(task_id: str) -> int:
    from django.contrib.auth.models import User

    return User.objects.filter(username__startswith=f"row-of-{task_id}").count()


def _write_row(task: Any) -> None:
    from django.contrib.auth.models import User

    User.objects.create(username=f"row-of-{task.request.id}-{uuid.uuid4().hex[:6]}")


@pytest.fixture
def world(alias: str) -> Iterator[World]:
    app, store = django_store_app("atomic-gate", alias)
    world = World(app, store, rows)
    atomic_runs.register(world, _write_row)
    with recording(app, world.sent):
        yield world
        world.store.drop_namespace()  # type: ignore[attr-defined]


def test_an_atomic_run_commits_its_rows_and_its_end_together(world: World) -> None:
    atomic_runs.commits_with_its_end(world)


def test_a_body_that_raises_rolls_its_rows_back_and_ends_failed(world: World) -> None:
    atomic_runs.rolls_back_and_fails(world)


def test_scenario_77_a_run_that_dies_mid_body_leaves_the_job_to_run_once_again(
    world: World,
) -> None:
    atomic_runs.dies_and_runs_once_again(world)


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
    atomic_runs.child_iff_committed(world, action)


def test_scenario_77_a_duplicate_waits_on_the_row_lock_and_does_not_run_again(
    world: World,
) -> None:
    """The second delivery's gate waits for the first's transaction, then finds the job ended."""
    from django.db import connections

    alias = world.store.alias  # type: ignore[attr-defined]
    vendor = connections[alias].vendor  # postgresql, mysql, sqlite
    if vendor not in LOCK_WAITS:
        pytest.skip("a row lock (SQLite's writer lock is the whole file)")

    def waiting() -> bool:
        with connections[alias].cursor() as cursor:
            cursor.execute(LOCK_WAITS[vendor])
            return int(cursor.fetchone()[0]) > 0

    atomic_runs.duplicate_waits_on_the_row_lock(world, waiting, each_thread=connections.close_all)


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
