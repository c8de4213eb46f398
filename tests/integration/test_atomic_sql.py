"""The atomic gate on the SQL store: a SQLAlchemy body's rows and its job's end commit together.

A body writes through ``self.request.exactonce.connection`` (a SQLAlchemy
``Connection`` of the store's engine) on the URLs users write
(``postgresql://``, ``mysql://``, ``sqlite:///``). Deliveries are handed to
the gate in this thread (a second one, for the row lock), as a worker would.
The store's own transaction (``SqlStore.transaction``) is tested first.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_exactonce import ExactOnceTask, runtime
from celery_exactonce.core import exceptions
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.stores.sql.store import SqlStore
from celery_exactonce.task import atomic
from tests import services
from tests.support.backends import store_url
from tests.support.deliveries import deliver_to
from tests.support.helpers import poll, task_job
from tests.support.publishing import recording

#: How long a test waits for a thread to reach a point (polled), at most.
DEADLINE = 20.0
#: The app's own table the bodies write to.
CHARGES = sa.Table(
    "atomic_sql_charges",
    sa.MetaData(),
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("task_id", sa.String(64), nullable=False),
)


class Died(BaseException):
    """What a worker's death mid-body looks like from inside it (nothing after it runs)."""


@pytest.fixture(params=["postgres", "mysql", "sqlite"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param != "sqlite":
        services.need(request.param)
    return store_url(request.param, str(tmp_path))


@dataclass
class World:
    app: Celery
    store: SqlStore
    #: What the body does after writing its row: "return", "raise", "die", "child", "wait".
    action: str = "return"
    sent: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    inside: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def job(self, job_id: str) -> Any:
        return self.store.get(JobRef.submitted(job_id))

    def deliver(self, index: int = 0) -> str:
        task_id, headers = self.sent[index]
        return deliver_to(self.app.tasks[headers["task"]], task_id, headers)

    def rows(self, task_id: str) -> int:
        with self.store.engine.connect() as conn:
            query = sa.select(sa.func.count()).where(CHARGES.c.task_id == task_id)
            return int(conn.execute(query).scalar_one())


def _child(n: int) -> int:
    return n


@pytest.fixture
def world(url: str) -> Iterator[World]:
    app = Celery("atomic-sql", broker="memory://", set_as_current=False)
    app.conf.update(exactonce_store_url=url, exactonce_namespace=f"a{uuid.uuid4().hex[:10]}")
    store = runtime.runtime_for(app).store
    assert isinstance(store, SqlStore)
    store.setup()
    CHARGES.create(store.engine, checkfirst=True)
    world = World(app, store)

    def charge(self: Any, n: int) -> str:
        connection = self.request.exactonce.connection
        connection.execute(CHARGES.insert().values(id=uuid.uuid4().hex, task_id=self.request.id))
        if world.action == "raise":
            raise ValueError("the charge was declined")
        if world.action == "die":
            world.action = "return"  # the next run, after the restart, gets through
            raise Died()
        if world.action in ("child", "child then raise"):
            app.tasks["t.child"].delay(n)
            if world.action == "child then raise":
                raise ValueError("after the child")
        if world.action == "wait":
            world.inside.set()
            assert world.release.wait(DEADLINE)
        return "charged"

    app.task(base=ExactOnceTask, shared=False, bind=True, name="t.charge", exactonce_atomic=True)(
        charge
    )
    app.task(base=ExactOnceTask, shared=False, name="t.child")(_child)
    with recording(app, world.sent):
        try:
            yield world
        finally:
            with store.engine.begin() as conn:
                conn.execute(CHARGES.delete())
            store.drop_namespace()


# -- the store's transaction ------------------------------------------------------------


def test_operations_inside_the_transaction_commit_with_the_caller_s_rows(world: World) -> None:
    store, ran = world.store, []
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
    store, ran = world.store, []
    with pytest.raises(RuntimeError), store.transaction() as conn:
        assert store.create(task_job("undone")).created
        conn.execute(CHARGES.insert().values(id="r2", task_id="undone"))
        store.after_commit()(lambda: ran.append("published"))  # type: ignore[misc]
        raise RuntimeError("the body failed")
    assert store.get(JobRef.submitted("undone")) is None
    assert world.rows("undone") == 0
    assert ran == []  # never after a rollback


def test_a_transaction_is_not_nested_on_one_thread(world: World) -> None:
    with world.store.transaction():
        nested = world.store.transaction()
        with pytest.raises(exceptions.StoreError, match="open"):
            nested.__enter__()


# -- the atomic gate --------------------------------------------------------------------


def test_an_atomic_run_commits_its_rows_and_its_end_together(world: World) -> None:
    world.app.tasks["t.charge"].apply_async((1,), task_id="ok")
    assert world.deliver() == "ran"
    assert world.rows("ok") == 1
    job = world.job("ok")
    assert (job.state, job.reason) == (State.SUCCEEDED, atomic.COMMITTED)
    assert world.deliver() == "ignored"  # a duplicate of it: the job has ended
    assert world.rows("ok") == 1


def test_a_body_that_raises_rolls_its_rows_back_and_ends_failed(world: World) -> None:
    world.action = "raise"
    world.app.tasks["t.charge"].apply_async((1,), task_id="no")
    with pytest.raises(ValueError, match="declined"):
        world.deliver()
    assert world.rows("no") == 0
    job = world.job("no")
    assert job.state is State.FAILED
    assert "the charge was declined" in job.reason


def test_scenario_77_a_run_that_dies_mid_body_leaves_the_job_to_run_once_again(
    world: World,
) -> None:
    world.action = "die"
    world.app.tasks["t.charge"].apply_async((1,), task_id="died")
    with pytest.raises(Died):
        world.deliver()
    assert world.rows("died") == 0
    assert world.job("died").state is State.DISPATCHED  # never seen RUNNING by anyone
    assert world.deliver() == "ran"  # the redelivery (or the reconciler's redispatch)
    assert world.deliver() == "ignored"
    assert world.rows("died") == 1
    assert world.job("died").state is State.SUCCEEDED


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
    else:  # nor is there a record of one: it was written in the rolled-back transaction
        with world.store.engine.connect() as conn:
            jobs = world.store._t.jobs
            query = sa.select(sa.func.count()).where(
                jobs.c.namespace == world.store.namespace, jobs.c.task == "t.child"
            )
            assert conn.execute(query).scalar_one() == 0
    assert world.rows("parent") == (1 if committed else 0)


#: How a test sees a statement waiting for a row lock, per database.
LOCK_WAITS = {
    "postgresql": "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
    "AND datname = current_database()",
    "mysql": "SELECT count(*) FROM information_schema.processlist "
    "WHERE state = 'Updating' AND info LIKE 'UPDATE exactonce_jobs %'",
}


def _waiting_on_a_lock(store: SqlStore) -> bool:
    with store.engine.connect() as conn:
        query = LOCK_WAITS[store.engine.dialect.name]
        return int(conn.execute(sa.text(query)).scalar_one()) > 0


def test_scenario_77_a_duplicate_waits_on_the_row_lock_and_does_not_run_again(
    world: World,
) -> None:
    """The second delivery's gate waits for the first's transaction, then finds the job ended."""
    if world.store.engine.dialect.name not in LOCK_WAITS:
        pytest.skip("a row lock (SQLite's writer lock is the whole file)")
    world.action = "wait"
    world.app.tasks["t.charge"].apply_async((1,), task_id="dup")
    verdicts: dict[str, str] = {}

    def deliver(name: str) -> None:
        verdicts[name] = world.deliver()

    first = threading.Thread(target=deliver, args=("first",))
    first.start()
    assert world.inside.wait(DEADLINE)
    world.action = "return"  # (were the second to run the body, it would not wait)
    second = threading.Thread(target=deliver, args=("second",))
    second.start()
    poll(lambda: _waiting_on_a_lock(world.store) or not second.is_alive(), timeout=DEADLINE)
    assert second.is_alive(), verdicts
    world.release.set()
    first.join(DEADLINE)
    second.join(DEADLINE)
    assert verdicts == {"first": "ran", "second": "ignored"}
    assert world.rows("dup") == 1
