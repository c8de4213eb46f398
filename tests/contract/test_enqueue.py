"""The one-write submit of the SQL stores: ``enqueue``, a record created already ``DISPATCHED``.

Per SQL store (the others have no such write, or push a message with it: the
Redis one-step submit, ``tests/integration/test_enqueue.py``). One statement
writes the record as a create then a ``SCHEDULED → DISPATCHED`` transition
would: the gate takes it as any dispatched job; a ref that exists is answered
with its record, unchanged.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from celery_exactonce.core.exceptions import InvalidRequest
from celery_exactonce.core.jobs import CreateStatus, HistoryEntry, apply_transition, job_from_new
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.stores.base import StateStore
from celery_exactonce.stores.sql.store import SqlStore
from tests.support.backends import DJANGO_BACKENDS

#: The SQL stores, the Django ones among them: the others have no such write.
SQL_BACKENDS = ("postgres", "mysql", "sqlite", *DJANGO_BACKENDS)


def _on(*backends: str) -> pytest.MarkDecorator:
    """A test run on ``backends``, the store's own fixture made for each."""
    return pytest.mark.parametrize("backend", backends, indirect=True)


ON_EVERY_SQL_STORE = _on(*SQL_BACKENDS)


@pytest.fixture
def sql_store(store: StateStore) -> Any:
    assert isinstance(store, SqlStore)
    return store


def _new(job_id: str = "e1", **kw: Any) -> NewJob:
    return NewJob(
        JobRef.submitted(job_id),
        "t.add",
        State.SCHEDULED,
        node="submitter",
        args=[1, 2],
        kwargs={"k": "é"},
        options={"exactonce_gated": True, "queue": "q"},
        reason="apply_async",
        **kw,
    )


def _dispatch(new: NewJob) -> Transition:
    return Transition(
        State.DISPATCHED,
        frozenset({State.SCHEDULED}),
        node="submitter",
        reason="apply_async",
        rev=new.rev,
    )


@ON_EVERY_SQL_STORE
def test_enqueue_writes_the_record_a_create_and_its_dispatch_write(sql_store: Any) -> None:
    new = _new()
    dispatch = _dispatch(new)
    before = sql_store.now()
    result = sql_store.enqueue(new, dispatch)
    assert result.status is CreateStatus.CREATED and result.job is not None
    stored = sql_store.get(new.ref)
    assert stored is not None
    # The record is the create then the dispatch, every time the statement's store time
    at = stored.created_at
    assert before <= at <= sql_store.now()
    assert stored == apply_transition(job_from_new(new, at), dispatch, at)
    assert stored.state is State.DISPATCHED and stored.rev == dispatch.new_rev
    assert stored.dispatches == 1 and stored.touched_at == at
    assert [(h.src, h.dst, h.at) for h in stored.history] == [
        (None, State.SCHEDULED, at),
        (State.SCHEDULED, State.DISPATCHED, at),
    ]
    # What it answered is that record, built without reading it back (the times: the store's
    # where the statement answers them, else this process's estimate)
    assert result.job.ref == stored.ref and result.job.rev == stored.rev
    assert result.job.history[-1] == HistoryEntry(
        State.SCHEDULED,
        State.DISPATCHED,
        result.job.touched_at,
        "submitter",
        "apply_async",
        dispatch.new_rev,
    )
    # And the gate takes it as any dispatched job
    gate = Transition(
        State.RUNNING,
        frozenset({State.SCHEDULED, State.DISPATCHED}),
        node="worker",
        reason="gate",
        attempt=0,
        new_run_id="run-1",
    )
    assert sql_store.transition(new.ref, gate).applied


@ON_EVERY_SQL_STORE
def test_enqueue_runs_meanwhile_once_whether_or_not_the_ref_exists(sql_store: Any) -> None:
    # Given the caller's message build, run while the write is on the way (or first)
    seen: list[State | None] = []

    def meanwhile() -> None:
        seen.append(None)

    new = _new("e-meanwhile")
    dispatch = _dispatch(new)
    # When the record is enqueued, then enqueued again (the ref exists)
    first = sql_store.enqueue(new, dispatch, meanwhile=meanwhile)
    again = sql_store.enqueue(new, dispatch, meanwhile=meanwhile)
    # Then each call ran it once, and answered as without it
    assert len(seen) == 2
    assert first.status is CreateStatus.CREATED
    assert again.status is CreateStatus.EXISTS and again.job == sql_store.get(new.ref)
    # And it overlaps the statement on PostgreSQL (psycopg 3, in autocommit) and on
    # MySQL/MariaDB (PyMySQL), not on SQLite
    dialect = sql_store.engine.dialect
    overlapping = dialect.name == "postgresql" or (
        dialect.name == "mysql" and dialect.driver == "pymysql"
    )
    assert sql_store.enqueue_overlaps is overlapping


@ON_EVERY_SQL_STORE
def test_enqueue_of_a_ref_that_exists_answers_its_record_unchanged(sql_store: Any) -> None:
    new = _new("e2")
    dispatch = _dispatch(new)
    assert sql_store.enqueue(new, dispatch).created
    written = sql_store.get(new.ref)
    # Repeated (its answer lost, say): EXISTS with the record, whose rev is the dispatch's
    again = sql_store.enqueue(new, dispatch)
    assert again.status is CreateStatus.EXISTS and again.job == written
    assert again.job is not None and again.job.rev == dispatch.new_rev
    # Another submit of the same ref: EXISTS, nothing written
    other = _new("e2")
    answer = sql_store.enqueue(other, _dispatch(other))
    assert answer.status is CreateStatus.EXISTS and answer.job == written
    assert sql_store.get(new.ref) == written
    # And a record created the general way is answered as it is
    plain = _new("e3")
    assert sql_store.create(plain).created
    created = sql_store.get(plain.ref)
    late = _new("e3")
    assert sql_store.enqueue(late, _dispatch(late)).job == created
    assert sql_store.get(plain.ref) == created


@ON_EVERY_SQL_STORE
def test_enqueue_takes_a_scheduled_job_and_its_dispatch_only(sql_store: Any) -> None:
    pending = NewJob(
        JobRef.submitted("e4"),
        "t.add",
        State.PENDING,
        node="n",
        run_at=sql_store.now() + timedelta(hours=1),
    )
    with pytest.raises(InvalidRequest):
        sql_store.enqueue(pending, _dispatch(pending))
    new = _new("e5")
    running = Transition(
        State.RUNNING, frozenset({State.SCHEDULED}), node="n", reason="r", new_run_id="x"
    )
    with pytest.raises(InvalidRequest):
        sql_store.enqueue(new, running)
    assert sql_store.get(new.ref) is None and sql_store.get(pending.ref) is None


@_on("mysql")
def test_enqueue_without_insert_returning_writes_the_record_and_answers_exists(
    sql_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MySQL has no ``INSERT … RETURNING``: the insert alone, the duplicate key its refusal."""
    monkeypatch.setattr(sql_store, "_insert_returning", lambda: False)
    new = _new("e6")
    dispatch = _dispatch(new)
    assert sql_store.enqueue(new, dispatch).created
    stored = sql_store.get(new.ref)
    assert stored is not None and stored.state is State.DISPATCHED
    assert stored.rev == dispatch.new_rev and stored.history[0].at == stored.history[1].at
    again = sql_store.enqueue(new, dispatch)
    assert again.status is CreateStatus.EXISTS and again.job == stored


_LOCK_WAIT = {  # a second writer waits this long (about 2 s) for a lock before it fails
    "postgresql": "SET lock_timeout = '2s'",
    "mysql": "SET SESSION innodb_lock_wait_timeout = 2",
}


@_on("postgres", "mysql", "sqlite")
def test_the_insert_runs_alone_and_a_refused_one_leaves_no_lock_behind(sql_store: Any) -> None:
    """The one statement commits at once; a duplicate key (MySQL: an error) lets its row go.

    On MySQL a refused ``INSERT`` share-locks the record it met until its
    transaction ends; the statement's transaction is rolled back before its
    connection goes back to the pool, where it would hold the lock unseen.
    """
    new = _new("e7")
    dispatch = _dispatch(new)
    assert sql_store.enqueue(new, dispatch).created
    stmt, params = sql_store._sql.enqueue(
        sql_store.namespace, new, dispatch, returning=sql_store._enqueue_returning()
    )
    assert sql_store._run_statement("enqueue", stmt, params) is None  # the key exists
    # Another connection writes the record at once: nothing of the store's holds it
    jobs = sql_store._t.jobs
    other = sa.create_engine(sql_store.engine.url, poolclass=sa.pool.NullPool)
    if other.dialect.name == "sqlite":
        other = sa.create_engine(
            sql_store.engine.url, poolclass=sa.pool.NullPool, connect_args={"timeout": 2}
        )
    try:
        with other.connect() as conn, conn.begin():
            if other.dialect.name in _LOCK_WAIT:
                conn.exec_driver_sql(_LOCK_WAIT[other.dialect.name])
            written = conn.execute(
                jobs.update()
                .where(jobs.c.namespace == sql_store.namespace, jobs.c.id == new.ref.id)
                .values(reason="touched")
            )
            assert written.rowcount == 1
    finally:
        other.dispose()
    stored = sql_store.get(new.ref)
    assert stored is not None and stored.reason == "touched"
    if sql_store.engine.dialect.name == "postgresql":  # its pooled connection is as it was
        raw = sql_store.engine.raw_connection()
        try:
            assert raw.driver_connection.autocommit is False
        finally:
            raw.close()


@_on("django-postgres")
def test_on_django_postgresql_the_insert_keeps_a_plan_and_the_connection_its_settings(
    sql_store: Any,
) -> None:
    """On Django's psycopg 3 connection the ``INSERT`` is prepared once and keeps its plan;
    the connection's cursors and planning mode are Django's as before."""
    import psycopg
    from django.db import connections

    def plans() -> list[tuple[int, int]]:
        query = (
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
            " WHERE name LIKE 'exactonce%'"
        )
        return list(connections[sql_store.alias].connection.execute(query).fetchall())

    first = _new("e-kept-first")
    assert sql_store.enqueue(first, _dispatch(first)).created
    driver = connections[sql_store.alias].connection
    mode = driver.execute("SHOW plan_cache_mode").fetchone()
    ((generic, custom),) = plans()
    # When more records are enqueued outside any transaction
    for i in range(3):
        new = _new(f"e-kept-{i}")
        assert sql_store.enqueue(new, _dispatch(new)).created
    # Then the INSERT ran each time on its one generic plan, prepared on Django's connection
    assert generic >= 1 and plans() == [(generic + 3, custom)]
    # And the connection is as Django left it: client-side binding, its own mode
    assert issubclass(driver.cursor_factory, psycopg.ClientCursor)
    assert driver.execute("SHOW plan_cache_mode").fetchone() == mode


@_on("django-postgres")
def test_on_django_postgresql_the_gate_and_the_completion_keep_their_plans(
    sql_store: Any,
) -> None:
    """The run's two brief writes, alone in Django's autocommit, keep a plan by the key."""
    from django.db import connections

    def generic_plans() -> int:
        query = "SELECT sum(generic_plans) FROM pg_prepared_statements WHERE name LIKE 'exactonce%'"
        return int(connections[sql_store.alias].connection.execute(query).fetchone()[0] or 0)

    def run(job_id: str) -> None:
        new = _new(job_id)
        assert sql_store.enqueue(new, _dispatch(new)).created
        run_id = f"run-{job_id}"
        gate = Transition(
            State.RUNNING,
            frozenset({State.DISPATCHED}),
            node="worker",
            reason="gate",
            attempt=0,
            new_run_id=run_id,
        )
        done = Transition(
            State.SUCCEEDED, frozenset({State.RUNNING}), node="worker", reason="ok", run_id=run_id
        )
        for request in (gate, done):
            (result,) = sql_store.transition_many([(new.ref, request)], brief=True)
            assert result.applied

    run("e-gate-first")
    before = generic_plans()
    # When another job is submitted, passes the gate and ends
    run("e-gate-second")
    # Then its INSERT, its gate's CAS and its completion each ran on a kept generic plan
    assert generic_plans() == before + 3
    assert sql_store.get(JobRef.submitted("e-gate-second")).state is State.SUCCEEDED


@_on("mysql")
def test_on_mysql_the_work_meanwhile_runs_after_the_insert_is_sent_before_its_answer(
    sql_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PyMySQL: the ``INSERT`` and its ``COMMIT`` go in one message, the caller's work runs
    while they are on the server, and the answers are read after it; a duplicate key is
    refused as before, its transaction let go."""
    from pymysql.connections import Connection

    events: list[str] = []
    send, read = Connection._execute_command, Connection._read_query_result

    def sent(self: Any, command: int, sql: Any) -> Any:
        text = sql if isinstance(sql, str) else sql.decode()
        if "INSERT" in text:
            events.append("sent" + (" with its COMMIT" if text.endswith("; COMMIT") else ""))
        return send(self, command, sql)

    def answered(self: Any, *args: Any, **kwargs: Any) -> Any:
        events.append("read")
        return read(self, *args, **kwargs)

    monkeypatch.setattr(Connection, "_execute_command", sent)
    monkeypatch.setattr(Connection, "_read_query_result", answered)
    new = _new("e-wire")
    dispatch = _dispatch(new)
    # When a record is enqueued, then enqueued again (its key exists)
    first = sql_store.enqueue(new, dispatch, meanwhile=lambda: events.append("meanwhile"))
    assert first.created and sql_store.enqueue_overlaps is True
    assert events[:4] == ["sent with its COMMIT", "meanwhile", "read", "read"]
    del events[:]
    again = sql_store.enqueue(new, dispatch, meanwhile=lambda: events.append("meanwhile"))
    # Then the work ran once while each was out; the second is answered with the record
    assert events[:3] == ["sent with its COMMIT", "meanwhile", "read"]
    assert again.status is CreateStatus.EXISTS and again.job == sql_store.get(new.ref)
