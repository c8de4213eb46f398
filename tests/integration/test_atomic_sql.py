"""The atomic gate on the SQL store: a SQLAlchemy body's rows and its job's end commit together.

A body writes through ``self.request.exactonce.connection`` (a SQLAlchemy
``Connection`` of the store's engine) on the URLs users write
(``postgresql://``, ``mysql://``, ``sqlite:///``). Deliveries are handed to
the gate in this thread (a second one, for the row lock), as a worker would.
The store's own transaction (``SqlStore.transaction``) is tested first.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_exactonce import runtime
from celery_exactonce.core import exceptions
from celery_exactonce.core.refs import JobRef
from celery_exactonce.observe import metrics
from celery_exactonce.stores.sql.store import SqlStore
from tests import services
from tests.support import atomic_runs
from tests.support.atomic_runs import LOCK_WAITS, World
from tests.support.backends import store_url
from tests.support.helpers import task_job
from tests.support.publishing import recording

#: The app's own table the bodies write to.
CHARGES = sa.Table(
    "atomic_sql_charges",
    sa.MetaData(),
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("task_id", sa.String(64), nullable=False),
)


@pytest.fixture(params=["postgres", "mysql", "sqlite"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param != "sqlite":
        services.need(request.param)
    return store_url(request.param, str(tmp_path))


def _store(world: World) -> SqlStore:
    assert isinstance(world.store, SqlStore)
    return world.store


def _write_row(task: Any) -> None:
    connection = task.request.exactonce.connection  # the run's transaction (SQLAlchemy)
    connection.execute(CHARGES.insert().values(id=uuid.uuid4().hex, task_id=task.request.id))


@pytest.fixture
def world(url: str) -> Iterator[World]:
    app = Celery("atomic-sql", broker="memory://", set_as_current=False)
    app.conf.update(exactonce_store_url=url, exactonce_namespace=f"a{uuid.uuid4().hex[:10]}")
    store = runtime.runtime_for(app).store
    assert isinstance(store, SqlStore)
    store.setup()
    CHARGES.create(store.engine, checkfirst=True)

    def rows(task_id: str) -> int:
        with store.engine.connect() as conn:
            query = sa.select(sa.func.count()).where(CHARGES.c.task_id == task_id)
            return int(conn.execute(query).scalar_one())

    world = World(app, store, rows)
    atomic_runs.register(world, _write_row)
    with recording(app, world.sent):
        try:
            yield world
        finally:
            with store.engine.begin() as conn:
                conn.execute(CHARGES.delete())
            store.drop_namespace()


# -- the store's transaction ------------------------------------------------------------


def test_operations_inside_the_transaction_commit_with_the_caller_s_rows(world: World) -> None:
    store, ran = _store(world), []
    with store.transaction() as conn:
        assert store.create(task_job("inside")).created
        conn.execute(CHARGES.insert().values(id="r1", task_id="inside"))
        register = store.after_commit()
        assert register is not None
        register(lambda: ran.append(world.rows("inside")))
        assert ran == []  # not before the commit
    assert ran == [1]  # after it: the row is there for everyone
    assert store.get(JobRef.submitted("inside")) is not None
    assert store.after_commit() is None  # outside one: an operation commits at once


def test_a_transaction_that_raises_takes_the_store_s_writes_back_with_the_caller_s(
    world: World,
) -> None:
    store, ran = _store(world), []
    with pytest.raises(RuntimeError), store.transaction() as conn:
        assert store.create(task_job("undone")).created
        conn.execute(CHARGES.insert().values(id="r2", task_id="undone"))
        store.after_commit()(lambda: ran.append("published"))  # type: ignore[misc]
        raise RuntimeError("the body failed")
    assert store.get(JobRef.submitted("undone")) is None
    assert world.rows("undone") == 0
    assert ran == []  # never after a rollback


def test_a_function_that_fails_after_the_commit_leaves_the_commit_and_is_reported(
    world: World,
) -> None:
    store, ran = _store(world), []

    def fails() -> None:
        raise RuntimeError("the publish failed")

    before = metrics.COUNTERS.get("after_commit_failed")
    with store.transaction() as conn:
        conn.execute(CHARGES.insert().values(id="r3", task_id="kept"))
        store.after_commit()(fails)  # type: ignore[misc]
        store.after_commit()(lambda: ran.append("next"))  # type: ignore[misc]
    assert world.rows("kept") == 1
    assert ran == ["next"]  # the others still run
    assert metrics.COUNTERS.get("after_commit_failed") == before + 1


def test_a_transaction_is_not_nested_on_one_thread(world: World) -> None:
    with _store(world).transaction():
        nested = _store(world).transaction()
        with pytest.raises(exceptions.StoreError, match="open"):
            nested.__enter__()


# -- the atomic gate, the body writing through self.request.exactonce.connection ----------


def test_an_atomic_run_commits_its_rows_and_its_end_together(world: World) -> None:
    atomic_runs.commits_with_its_end(world)


def test_a_body_that_raises_rolls_its_rows_back_and_ends_failed(world: World) -> None:
    atomic_runs.rolls_back_and_fails(world)


def test_scenario_77_a_run_that_dies_mid_body_leaves_the_job_to_run_once_again(
    world: World,
) -> None:
    atomic_runs.dies_and_runs_once_again(world)


@pytest.mark.parametrize("action", ["child", "child then raise"])
def test_scenario_78_a_child_exists_and_is_published_iff_its_parent_committed(
    world: World, action: str
) -> None:
    atomic_runs.child_iff_committed(world, action)
    if action == "child then raise":  # nor is there a record of one: it was rolled back
        store = _store(world)
        with store.engine.connect() as conn:
            jobs = store._t.jobs
            query = sa.select(sa.func.count()).where(
                jobs.c.namespace == store.namespace, jobs.c.task == "t.child"
            )
            assert conn.execute(query).scalar_one() == 0


def test_scenario_77_a_duplicate_waits_on_the_row_lock_and_does_not_run_again(
    world: World,
) -> None:
    """The second delivery's gate waits for the first's transaction, then finds the job ended."""
    store = _store(world)
    dialect = store.engine.dialect.name
    if dialect not in LOCK_WAITS:
        pytest.skip("a row lock (SQLite's writer lock is the whole file)")

    def waiting() -> bool:
        with store.engine.connect() as conn:
            return int(conn.execute(sa.text(LOCK_WAITS[dialect])).scalar_one()) > 0

    atomic_runs.duplicate_waits_on_the_row_lock(world, waiting)
