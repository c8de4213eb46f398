"""SqlStore against real servers: its connections, and the ways its one-statement writes fall back.

The contract suite holds every store to the same answers; these tests look
at what only the SQL store has: pooled connections checked without a round
trip, MySQL's pool reset, and the locking transaction a one-statement write
hands over to (a snapshot that began before a competing create committed, a
history the statement cannot extend, a MySQL without ``INSERT … RETURNING``).
"""

from __future__ import annotations

import dataclasses
import re
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_exactonce.core import jobs, times
from celery_exactonce.core.jobs import CreateStatus, TransitionStatus
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.stores.sql import pgwire
from celery_exactonce.stores.sql import statements as sql_statements
from celery_exactonce.stores.sql.store import SqlStore
from tests import services
from tests.support.backends import store_url
from tests.support.helpers import occurrence, poll, pooled_driver, task_job, to

SERVERS = ("postgres", "mysql")


def _store(backend: str, tmp_path: Path, namespace: str | None = None) -> SqlStore:
    if backend in SERVERS:
        services.need(backend)
    store = SqlStore.from_url(
        _url(backend, tmp_path),
        namespace=namespace or f"t{uuid.uuid4().hex[:12]}",
        retention=3600.0,
    )
    store.setup()
    return store


def _url(backend: str, tmp_path: Path) -> str:
    url = store_url(backend, str(tmp_path))
    return url.replace("postgresql://", "postgresql+psycopg://").replace(
        "mysql://", "mysql+pymysql://"
    )


@pytest.fixture(params=(*SERVERS, "sqlite"))
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SqlStore]:
    store = _store(request.param, tmp_path)
    yield store
    store.drop_namespace()
    store.close()


@pytest.fixture(params=SERVERS)
def server_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SqlStore]:
    store = _store(request.param, tmp_path)
    yield store
    store.drop_namespace()
    store.close()


def _pings(store: SqlStore, monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Record every ping the store's dialect sends (the round trip ``pool_pre_ping`` paid)."""
    pings: list[object] = []
    real = store.engine.dialect.do_ping

    def ping(dbapi_conn: Any) -> bool:
        pings.append(dbapi_conn)
        return bool(real(dbapi_conn))

    monkeypatch.setattr(store.engine.dialect, "do_ping", ping)
    return pings


def _session_id(conn: sa.Connection) -> int:
    query = (
        "SELECT pg_backend_pid()" if conn.dialect.name == "postgresql" else "SELECT CONNECTION_ID()"
    )
    return int(conn.exec_driver_sql(query).scalar_one())


def _sessions(engine: sa.Engine) -> set[int]:
    query = (
        "SELECT pid FROM pg_stat_activity"
        if engine.dialect.name == "postgresql"
        else "SELECT id FROM information_schema.processlist"
    )
    with engine.connect() as conn:
        return {int(row[0]) for row in conn.exec_driver_sql(query)}


def test_a_healthy_pooled_connection_is_used_without_a_ping(
    server_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    pings = _pings(server_store, monkeypatch)
    new = task_job()
    assert server_store.create(new).created
    assert server_store.transition(new.ref, to(State.DISPATCHED, State.SCHEDULED)).applied
    assert server_store.get(new.ref) is not None
    assert pings == []


def test_a_pooled_connection_the_server_closed_is_replaced_before_use(
    server_store: SqlStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a pooled connection whose server session is killed while it is idle
    server_store.ping()
    with server_store.engine.connect() as conn:
        victim = _session_id(conn)
    killer = sa.create_engine(server_store.engine.url, poolclass=sa.pool.NullPool)
    try:
        with killer.connect() as conn:
            if killer.dialect.name == "postgresql":
                conn.exec_driver_sql(f"SELECT pg_terminate_backend({victim})")
            else:
                conn.exec_driver_sql(f"KILL {victim}")
        poll(lambda: victim not in _sessions(killer))
    finally:
        killer.dispose()
    pings = _pings(server_store, monkeypatch)
    # When the store next works, Then the dead connection is found (one ping, which fails)
    # and replaced before anything is sent on it: no error reaches the caller
    new = task_job()
    assert server_store.create(new).created
    assert len(pings) == 1
    assert server_store.get(new.ref) is not None
    with server_store.engine.connect() as conn:
        assert _session_id(conn) != victim


def test_a_mysql_connection_returned_inside_a_transaction_is_rolled_back(
    tmp_path: Path,
) -> None:
    store = _store("mysql", tmp_path)
    try:
        raw = store.engine.raw_connection()
        try:
            cursor = raw.cursor()
            cursor.execute(
                "INSERT INTO exactonce_leases (namespace, name, token, expires_at)"
                " VALUES (%s, 'left-open', 'tok', 0)",
                (store.namespace,),
            )
            cursor.close()
        finally:
            raw.close()  # back to the pool, its transaction open: the reset rolls it back
        assert store.acquire_lease("left-open", "other", 60)  # no row was left behind
    finally:
        store.drop_namespace()
        store.close()


def test_a_history_the_statement_cannot_extend_is_written_the_locking_way(
    store: SqlStore,
) -> None:
    new = task_job()
    assert store.create(new).created
    with store.engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE exactonce_jobs SET history = '[]' WHERE namespace = :ns"),
            {"ns": store.namespace},
        )
    before = store.get(new.ref)
    assert before is not None and before.history == ()
    request = to(State.DISPATCHED, State.SCHEDULED, rev=new.rev)
    result = store.transition(new.ref, request)
    assert result.applied and result.job is not None
    assert result.job == jobs.apply_transition(before, request, result.job.touched_at)
    assert store.get(new.ref) == result.job


def test_a_history_of_multibyte_text_is_capped_by_the_statement(store: SqlStore) -> None:
    # Given a job whose history holds text of several bytes a character
    new = task_job()
    assert store.create(new).created
    rev, written = new.rev, 0
    sent: list[str] = []
    sa.event.listen(store.engine, "before_cursor_execute", lambda *args: sent.append(str(args[2])))
    # When more writes than the history keeps go by the one statement (not the locking way)
    for i in range(jobs.HISTORY_LIMIT + 3):
        request = Transition(
            State.DISPATCHED,
            frozenset({State.SCHEDULED, State.DISPATCHED}),
            node="nœud-ü-✓",
            reason=f"écrit {i} ✓",
            rev=rev,
        )
        result = store.transition(new.ref, request)
        assert result.applied and result.job is not None
        rev, written = result.job.rev, written + 1
    # Then the history is capped at the limit, its entries whole, the newest last
    job = store.get(new.ref)
    assert job is not None and len(job.history) == jobs.HISTORY_LIMIT
    assert job.history[-1].reason == f"écrit {written - 1} ✓"
    assert {entry.node for entry in job.history[1:]} == {"nœud-ü-✓"}
    assert not any("FOR UPDATE" in statement for statement in sent)
    # and where the database keeps a text's byte length, the marks are counted in bytes
    counted = {"postgresql": r"\boctet_length\(", "mysql": r"\bLENGTH\("}.get(
        store.engine.dialect.name
    )
    if counted is not None:
        assert any(re.search(counted, statement) for statement in sent if "UPDATE" in statement)


def test_a_terminal_record_expires_from_its_slot_or_its_end(store: SqlStore) -> None:
    later = store.now() + timedelta(days=2)
    for new in (task_job(), occurrence("expiry", later)):
        store.create(new)
        result = store.transition(new.ref, to(State.CANCELLED, State.SCHEDULED))
        assert result.applied and result.job is not None
        with store.engine.connect() as conn:
            stored = conn.execute(
                sa.text(
                    "SELECT expires_at FROM exactonce_jobs"
                    " WHERE namespace = :ns AND space = :space AND id = :id"
                ),
                {"ns": store.namespace, "space": new.ref.space.value, "id": new.ref.id},
            ).scalar_one()
        expected = result.job.expires_at(store.retention)
        assert expected is not None and stored == times.to_micros(expected)


def test_a_heartbeat_reads_the_clock_once(store: SqlStore) -> None:
    new = task_job(state=State.RUNNING)
    store.create(new)
    assert new.run_id is not None and store.heartbeat(new.ref, new.run_id)
    job = store.get(new.ref)
    assert job is not None and job.touched_at == job.heartbeat_at


def _statements(store: SqlStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The first word of every statement the store sends from now on.

    On psycopg they are counted on the driver's cursors (:func:`_driver_statements`),
    which also see the statements the store runs on the driver itself, past
    SQLAlchemy's events.
    """
    if store.engine.dialect.driver == "psycopg":
        return _driver_statements(store, [], monkeypatch)
    sent: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        sent.append(statement.split(None, 1)[0].upper())

    sa.event.listen(store.engine, "before_cursor_execute", record)
    return sent


def _driver_statements(
    store: SqlStore, autocommit: list[bool], monkeypatch: pytest.MonkeyPatch
) -> list[str]:
    """psycopg: the first word of every statement sent from now on (on a cursor; after
    ``KEPT``: :mod:`~celery_exactonce.stores.sql.pgwire`'s); ``autocommit``: whether each ran
    outside a transaction (no ``BEGIN`` or ``COMMIT`` sent around it)."""
    import psycopg

    sent: list[str] = []

    class Counted(psycopg.Cursor[Any]):
        # The generator behind ``execute``, which the store may drive itself
        def _execute_gen(self, query: Any, *args: Any, **kwargs: Any) -> Any:
            sent.append(str(query).split(None, 1)[0].upper())
            autocommit.append(self.connection.autocommit)
            return super()._execute_gen(query, *args, **kwargs)

    def count_on(dbapi_conn: Any, *_: Any) -> None:
        dbapi_conn.cursor_factory = Counted

    real = pgwire.run_kept

    def run_kept(driver: Any, form: pgwire.Kept, *args: Any) -> Any:  # no cursor: its message
        sent.append("KEPT " + form.query.decode().split(None, 1)[0].upper())
        autocommit.append(driver.autocommit)
        return real(driver, form, *args)

    store.engine.dispose()  # every connection from now on is checked out, and counted
    sa.event.listen(store.engine, "checkout", count_on)
    monkeypatch.setattr(pgwire, "run_kept", run_kept)
    return sent


def test_each_write_of_a_submit_and_a_gate_is_one_statement(
    server_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The brief create (beat, a submit), the brief CAS (DISPATCHED, the gate, the
    # completion), and on PostgreSQL the create and CAS that answer with the record:
    # one statement each, the clock read inside it, no ping.
    sent = _statements(server_store, monkeypatch)
    new, other = task_job(), task_job()
    dispatched = to(State.DISPATCHED, State.SCHEDULED)
    writes = {
        "brief create": lambda: server_store.create_many([new], brief=True),
        "brief CAS": lambda: server_store.transition_many([(new.ref, dispatched)], brief=True),
        "create": lambda: server_store.create(other),
        "CAS": lambda: server_store.transition(other.ref, to(State.DISPATCHED, State.SCHEDULED)),
    }
    counts = {}
    for name, write in writes.items():
        sent.clear()
        write()
        counts[name] = len(sent)
    mariadb = server_store.engine.dialect.name == "mysql"
    # MariaDB has no UPDATE … RETURNING: a CAS that answers with the record reads it after.
    assert counts == {"brief create": 1, "brief CAS": 1, "create": 1, "CAS": 2 if mariadb else 1}
    assert server_store.get(new.ref).state is State.DISPATCHED  # type: ignore[union-attr]


@pytest.mark.parametrize("server_store", ["postgres"], indirect=True)
def test_the_gate_and_the_completion_are_one_round_trip_each_on_postgresql(
    server_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's two writes: each its statement alone, in autocommit (no BEGIN, no COMMIT)."""
    new = task_job()
    assert server_store.create(new).created
    autocommit: list[bool] = []
    sent = _driver_statements(server_store, autocommit, monkeypatch)
    # When the gate's CAS and the completion run, brief (as the worker sends them)
    gate = to(State.RUNNING, State.SCHEDULED, State.DISPATCHED, attempt=0, new_run_id="run-1")
    (entered,) = server_store.transition_many([(new.ref, gate)], brief=True)
    done = to(State.SUCCEEDED, State.RUNNING, run_id="run-1")
    (finished,) = server_store.transition_many([(new.ref, done)], brief=True)
    # Then each applied in one UPDATE sent in autocommit on a kept plan, and the record
    # is as written
    assert entered.applied and finished.applied
    assert (sent, autocommit) == (["KEPT WITH", "KEPT WITH"], [True, True])
    job = server_store.get(new.ref)
    assert job is not None and job.state is State.SUCCEEDED and job.run_id == "run-1"
    # And a refused one (the run no longer owns the job) answers the record, decided
    # the locking way
    (late,) = server_store.transition_many([(new.ref, done)], brief=True)
    assert late.status is TransitionStatus.CONFLICT
    assert late.job is not None and late.job.state is State.SUCCEEDED


@pytest.mark.parametrize("server_store", ["postgres"], indirect=True)
def test_writes_of_different_shapes_go_together_in_one_message_on_postgresql(
    server_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One run's outcome and the next run's gate: one message, one commit, each its key's
    kept plan; one that changed nothing is decided the locking way."""
    first, second, third = task_job(), task_job(), task_job()
    for new in (first, second, third):
        assert server_store.create(new).created
    gate = to(State.RUNNING, State.SCHEDULED, State.DISPATCHED, attempt=0, new_run_id="run-1")
    assert server_store.transition_many([(first.ref, gate)], brief=True)[0].applied
    messages: list[list[str]] = []
    real = pgwire.run_kept_many

    def counted(driver: Any, items: Any, *args: Any) -> Any:
        messages.append([form.query.decode().split(None, 1)[0].upper() for form, _ in items])
        return real(driver, items, *args)

    monkeypatch.setattr(pgwire, "run_kept_many", counted)
    done = to(State.SUCCEEDED, State.RUNNING, run_id="run-1")
    next_gate = dataclasses.replace(gate, new_run_id="run-2")
    # When the first run's outcome and the second's gate are written together
    ended, entered = server_store.transition_many(
        [(first.ref, done), (second.ref, next_gate)], brief=True
    )
    # Then both applied, in one message of two kept statements
    assert ended.applied and entered.applied
    assert messages == [["WITH", "WITH"]]
    assert server_store.get(first.ref).state is State.SUCCEEDED  # type: ignore[union-attr]
    assert server_store.get(second.ref).state is State.RUNNING  # type: ignore[union-attr]
    # And with one refused (the outcome again): the other applied, the refused one
    # answers the record as it is
    late, third_entered = server_store.transition_many(
        [(first.ref, done), (third.ref, next_gate)], brief=True
    )
    assert third_entered.applied and late.status is TransitionStatus.CONFLICT
    assert late.job is not None and late.job.state is State.SUCCEEDED


@pytest.mark.parametrize("server_store", ["postgres"], indirect=True)
def test_a_submit_on_postgresql_sends_its_insert_and_commit_before_meanwhile_runs(
    server_store: SqlStore,
) -> None:
    """The message is built while the INSERT and its commit are on the way, not before."""
    from psycopg import pq

    new = task_job()
    dispatch = to(State.DISPATCHED, State.SCHEDULED, rev=new.rev)
    drivers: list[Any] = []
    server_store.engine.dispose()
    sa.event.listen(server_store.engine, "checkout", lambda driver, *_: drivers.append(driver))
    states: list[tuple[Any, bool]] = []

    def meanwhile() -> None:
        states.append((drivers[-1].pgconn.transaction_status, drivers[-1].autocommit))

    # When a submit's write runs with the message's build
    result = server_store.enqueue(new, dispatch, meanwhile=meanwhile)
    # Then the build ran once, the statement sent in autocommit and its answer still
    # to be read (the server's transaction active)
    assert states == [(pq.TransactionStatus.ACTIVE, True)]
    # And the record is written, committed (another connection reads it)
    assert result.created
    job = server_store.get(new.ref)
    assert job is not None and job.state is State.DISPATCHED and job.rev == dispatch.new_rev


@pytest.mark.parametrize("server_store", ["postgres"], indirect=True)
def test_a_submit_on_postgresql_keeps_its_inserts_plan_and_nothing_else(
    server_store: SqlStore,
) -> None:
    """The INSERT reads no table for its plan: it keeps one (no planning per submit),
    while every other statement on the connection is still planned on every run."""
    from psycopg import errors

    server_store.engine.dispose()  # one connection from now on (one thread): the test reads it
    # When more jobs are enqueued than PostgreSQL plans before it may keep a plan
    for _ in range(8):
        new = task_job()
        assert server_store.enqueue(new, to(State.DISPATCHED, State.SCHEDULED, rev=new.rev)).created
    # Then the INSERT ran on a kept (generic) plan, and the connection plans each run anew
    with pooled_driver(server_store) as driver:
        kept = driver.execute("SELECT generic_plans FROM pg_prepared_statements").fetchall()
        assert len(kept) == 1 and kept[0][0] >= 1
        assert driver.execute("SHOW plan_cache_mode").fetchone() == ("force_custom_plan",)
        # And a connection that lost its prepared statements prepares it again
        driver.execute("DEALLOCATE ALL")
    new = task_job()
    assert server_store.enqueue(new, to(State.DISPATCHED, State.SCHEDULED, rev=new.rev)).created
    assert server_store.get(new.ref) is not None
    # And one that finds it there already, unknown to this process (a server connection
    # behind a transaction pooler), runs it
    with pooled_driver(server_store) as driver:
        pgwire._PREPARED[driver].clear()
    new = task_job()
    assert server_store.enqueue(new, to(State.DISPATCHED, State.SCHEDULED, rev=new.rev)).created
    assert server_store.get(new.ref) is not None
    # And one that fails changes nothing: no record, the mode as it was, the connection idle
    stmt, params = server_store._sql.enqueue(
        server_store.namespace, task_job(), to(State.DISPATCHED, State.SCHEDULED), returning=True
    )
    form = pgwire.kept(str(stmt.compile(dialect=server_store.engine.dialect)))
    with pooled_driver(server_store) as driver:
        bad = pgwire.values_of(driver, form, {**params, "c_attempt": "x"})
        with pytest.raises(errors.InvalidTextRepresentation):
            pgwire.run_kept(driver, form, bad, None)
        assert driver.execute("SHOW plan_cache_mode").fetchone() == ("force_custom_plan",)
        assert driver.execute("SELECT 1").fetchone() == (1,)
    assert server_store.get(JobRef.submitted(params["k_id"])) is None


@pytest.mark.parametrize("server_store", ["mysql"], indirect=True)
def test_a_submit_on_mysql_is_one_round_trip_its_commit_in_the_insert_message(
    server_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's engine takes several statements a message: ``INSERT …; COMMIT``."""
    import pymysql
    from pymysql.constants import COMMAND

    sent: list[str] = []
    real = pymysql.connections.Connection._execute_command

    def counted(conn: Any, command: int, sql: Any) -> Any:
        if command == COMMAND.COM_QUERY:
            sent.append(sql if isinstance(sql, str) else sql.decode())
        return real(conn, command, sql)

    monkeypatch.setattr(pymysql.connections.Connection, "_execute_command", counted)
    new = task_job()
    dispatch = to(State.DISPATCHED, State.SCHEDULED, rev=new.rev)
    # When a gated submit writes its record
    assert server_store.enqueue(new, dispatch).created
    # Then one message went: the INSERT and its COMMIT
    assert len(sent) == 1
    assert sent[0].startswith("INSERT") and sent[0].endswith("; COMMIT")
    # And the record is committed (another connection reads it), the pooled
    # connection left with no transaction open
    raw = server_store.engine.raw_connection()
    try:
        status = raw.driver_connection.server_status  # type: ignore[union-attr]
        assert not status & 1  # SERVER_STATUS_IN_TRANS
    finally:
        raw.close()
    other = _store("mysql", Path("."), server_store.namespace)
    try:
        job = other.get(new.ref)
        assert job is not None and job.state is State.DISPATCHED
    finally:
        other.close()


def test_without_insert_returning_mysql_creates_the_locking_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _store("mysql", tmp_path)
    try:
        monkeypatch.setattr(store, "_insert_returning", lambda: False)
        epoch = store.epoch()
        new = task_job()
        created = store.create(new, epoch=epoch)
        assert created.created and created.job == store.get(new.ref)
        again = store.create(new)
        assert again.status is CreateStatus.EXISTS and again.job == created.job
        stale = store.create(task_job(), epoch="not-the-epoch")
        assert stale.status is CreateStatus.EPOCH_MISMATCH and stale.epoch == epoch
    finally:
        store.drop_namespace()
        store.close()


def _spy(store: SqlStore, name: str, monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Record the calls of one of the store's methods (the locking paths)."""
    calls: list[object] = []
    real = getattr(store, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(store, name, spy)
    return calls


@pytest.mark.parametrize("kind", ["task", "occurrence"])
def test_a_create_that_commits_after_the_statement_began_is_found(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL: a competing create commits while ours waits on its lock, after our snapshot.

    Our statement cannot see the record (its snapshot is older) and did not
    insert (the key or the mark was taken): the locking transaction reads the
    record and answers EXISTS with it.
    """
    store = _store("postgres", tmp_path)
    rival = _store("postgres", tmp_path, store.namespace)
    try:
        fire = store.now().replace(microsecond=0)
        new = task_job() if kind == "task" else occurrence("raced", fire)
        theirs = task_job(new.ref.id) if kind == "task" else occurrence("raced", fire)
        results: list[Any] = []
        locking = _spy(store, "_create", monkeypatch)
        with rival.engine.connect() as conn, conn.begin():
            # Their create, by the locking path, left uncommitted (it holds the key and the mark)
            rival._create(conn, theirs, None)
            thread = threading.Thread(target=lambda: results.append(store.create(new)))
            thread.start()
            poll(lambda: _waiting_on_a_lock(rival.engine))
        thread.join(timeout=30)
        assert len(results) == 1
        result = results[0]
        assert result.status is CreateStatus.EXISTS
        assert result.job is not None and result.job.rev == theirs.rev
        assert len(locking) == 1  # the statement could not tell; the transaction did
        if kind == "occurrence":
            assert store.watermark("raced") == fire
    finally:
        store.drop_namespace()
        for each in (store, rival):
            each.close()


def _waiting_on_a_lock(engine: sa.Engine) -> bool:
    with engine.connect() as conn:
        waiting = conn.exec_driver_sql(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND datname = current_database() AND query LIKE 'WITH clock%%'"
        ).scalar_one()
    return bool(waiting)


def test_an_occurrence_id_of_another_entry_fails_the_statement_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL: the mark of the second entry would move, so the whole statement fails."""
    store = _store("postgres", tmp_path)
    try:
        fire = store.now()
        first = occurrence("entry-one", fire)
        assert store.create(first).created
        locking = _spy(store, "_create", monkeypatch)
        other = NewJob(
            first.ref, "tasks.tick", State.SCHEDULED, node="n", entry="entry-two", fire_time=fire
        )
        result = store.create(other)
        assert result.status is CreateStatus.EXISTS and len(locking) == 1
        assert store.watermark("entry-two") is None
    finally:
        store.drop_namespace()
        store.close()


def test_a_conflict_answers_the_record_as_it_is(store: SqlStore) -> None:
    new = task_job()
    store.create(new)
    request = to(State.DISPATCHED, State.SCHEDULED, rev="not-the-rev")
    result = store.transition(new.ref, request)
    assert result.status is TransitionStatus.CONFLICT and result.job == store.get(new.ref)
    missing = store.transition(JobRef.submitted("ghost"), request)
    assert missing.status is TransitionStatus.NOT_FOUND and missing.job is None


@pytest.mark.parametrize("seconds", [0.0, 1e-6, 0.05, 0.1, 0.3, 1 / 3, 2.5, 3600.000001, 1e-7])
def test_the_stale_threshold_is_check_transitions(seconds: float) -> None:
    threshold = sql_statements.stale_micros(seconds)
    assert threshold / 1_000_000 >= seconds
    assert (threshold - 1) / 1_000_000 < seconds
    now = times.from_micros(10**15)
    for age in (threshold - 1, threshold):
        job = jobs.job_from_new(task_job(), times.from_micros(10**15 - age))
        request = Transition(
            State.DISPATCHED,
            frozenset({State.SCHEDULED}),
            node="n",
            reason="r",
            stale_for=seconds,
        )
        assert jobs.check_transition(job, request, now) is (age >= threshold)


def test_a_write_finds_its_row_by_the_key_not_by_its_state(tmp_path: Path) -> None:
    """PostgreSQL: with many jobs in one state, the guarded UPDATE still reads one row.

    ``namespace AND state`` is a prefix of the state indexes (partial: the
    live rows, the terminal ones; ``jobs_pending`` holds ``PENDING``); a guard
    on the state the planner could use would scan every job in that state
    (it did, before the guards were kept out of the index conditions).
    """
    store = _store("postgres", tmp_path)
    try:
        news = [task_job(f"plan-{i}") for i in range(500)]
        store.create_many(news, brief=True)
        running = task_job(state=State.RUNNING)
        store.create(running)
        with store.engine.connect() as conn:
            conn.exec_driver_sql("ANALYZE exactonce_jobs")
            request = to(State.DISPATCHED, State.SCHEDULED, rev=news[7].rev)
            for stmt, params in (
                store._sql.transition(store.namespace, news[7].ref, request, brief=False),
                store._sql.heartbeat(store.namespace, running.ref, "r"),
            ):
                compiled = stmt.compile(dialect=store.engine.dialect)
                plan = "\n".join(
                    row[0]
                    for row in conn.exec_driver_sql(
                        f"EXPLAIN {compiled}", compiled.construct_params(params)
                    )
                )
                assert "exactonce_jobs_pkey" in plan, plan
                others = ("jobs_live", "jobs_ended", "jobs_pending", "jobs_states", "jobs_due")
                assert not any(index in plan for index in others), plan
    finally:
        store.drop_namespace()
        store.close()


def _statements_of(store: SqlStore) -> list[str]:
    """The statements ``store`` sends from now on (a list that grows)."""
    sent: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if "exactonce_" in statement:
            sent.append(statement)

    sa.event.listen(store.engine, "before_cursor_execute", count)
    return sent


def test_a_batch_another_node_claimed_is_answered_by_one_read(
    store: SqlStore, tmp_path: Path
) -> None:
    """Every beat node but the first finds a tick's slots taken: one statement, not one a slot."""
    fire = store.now().replace(microsecond=0)
    batch = [occurrence(f"taken-{i:03}", fire) for i in range(50)]
    assert all(r.created for r in store.create_many(batch, brief=True))
    other = _store(
        store.engine.dialect.name.replace("postgresql", "postgres"), tmp_path, store.namespace
    )
    try:
        epoch = other.epoch()
        sent = _statements_of(other)
        results = other.create_many(batch, epoch=epoch, brief=True)
        assert {r.status for r in results} == {CreateStatus.EXISTS}
        assert len(sent) == 1, sent
    finally:
        other.close()


def test_a_batch_behind_another_nodes_reads_the_rest_again_once_a_slot_is_taken(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch that read its slots before another node's batch committed them.

    Its first create finds the slot taken (it waited for the other's commit):
    the rest are read again rather than created one by one. On PostgreSQL the
    batch is one statement, which answers every slot taken without a read again.
    """
    fire = store.now().replace(microsecond=0)
    batch = [occurrence(f"behind-{i:03}", fire) for i in range(50)]
    assert all(r.created for r in store.create_many(batch, brief=True))
    reads: list[int] = []
    decided = SqlStore._decided

    def read(self: SqlStore, conn: Any, news: Any, indices: Any, epoch: Any) -> Any:
        reads.append(len(indices))
        return {} if len(reads) == 1 else decided(self, conn, news, indices, epoch)

    monkeypatch.setattr(SqlStore, "_decided", read)
    epoch = store.epoch()
    sent = _statements_of(store)
    results = store.create_many(batch, epoch=epoch, brief=True)
    assert {r.status for r in results} == {CreateStatus.EXISTS}
    if store.engine.dialect.name == "postgresql":
        assert reads == [50]
        assert len(sent) <= 2, sent  # the read, the batch's one statement
        return
    assert reads == [50, 49]
    # One create (on the locking way: the clock, the mark locked, the record read), one read
    assert len(sent) <= 4, sent


def test_postgresql_plans_each_statement_for_the_tables_as_they_are(tmp_path: Path) -> None:
    """A generic plan made while the tables were empty would read a whole table per key."""
    store = _store("postgres", tmp_path)
    try:
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("SHOW plan_cache_mode").scalar() == "force_custom_plan"
    finally:
        store.drop_namespace()
        store.close()


def test_postgresql_finds_a_new_namespaces_jobs_by_their_key_after_another_was_analyzed(
    tmp_path: Path,
) -> None:
    """A namespace the last ANALYZE did not see is not estimated at no rows.

    With statistics of the namespace column, a new namespace's key lookups went
    by the expiry index (led by the namespace alone) and read every one of its
    jobs: claims slowed as the tables grew, to a fifth at 20,000 jobs.
    """
    services.need("postgres")
    prefix = f"t{uuid.uuid4().hex[:8]}_"
    url = _url("postgres", tmp_path)
    old = SqlStore.from_url(url, namespace="old", retention=3600.0, table_prefix=prefix)
    new = SqlStore.from_url(url, namespace="new", retention=3600.0, table_prefix=prefix)
    try:
        old.setup()
        fire = old.now().replace(microsecond=0)
        old.create_many([occurrence(f"e{i}", fire) for i in range(2000)], brief=True)
        with old.engine.begin() as conn:
            conn.exec_driver_sql(f"ANALYZE {prefix}jobs")
        claim = occurrence("e1", fire)
        stmt, params = new._sql.create_postgresql(new.namespace, claim, new.epoch())
        compiled = stmt.compile(dialect=new.engine.dialect)
        with new.engine.connect() as conn:
            plan = "\n".join(
                row[0]
                for row in conn.exec_driver_sql(
                    f"EXPLAIN {compiled}", compiled.construct_params(params)
                )
            )
        jobs_indexes = [
            name for name in ("_pkey", "_expiry", "_due", "_stale") if f"{prefix}jobs{name}" in plan
        ]
        assert jobs_indexes == ["_pkey"], plan
    finally:
        with old.engine.begin() as conn:
            old._t.metadata.drop_all(conn)
        old.close()
        new.close()


@pytest.mark.parametrize("server_store", ["postgres"], indirect=True)
def test_a_kept_plan_is_not_used_inside_a_transaction_the_connection_has_open(
    server_store: SqlStore,
) -> None:
    """Its ``Sync`` commits only outside a transaction: a connection in autocommit on which
    someone sent ``BEGIN`` runs the statement the ordinary way."""
    server_store.engine.dispose()
    with pooled_driver(server_store) as driver:
        assert pgwire.keeps(driver)
        driver.execute("BEGIN")
        try:
            assert not pgwire.keeps(driver)
        finally:
            driver.execute("ROLLBACK")
        assert pgwire.keeps(driver)


@pytest.mark.parametrize("server_store", ["postgres"], indirect=True)
def test_what_a_submits_build_raises_leaves_the_record_written_and_the_connection_open(
    server_store: SqlStore,
) -> None:
    """The build runs while the kept-plan INSERT is on the way: its error reaches the caller
    once the answer is read, the record written, the pooled connection still usable."""
    server_store.engine.dispose()
    with pooled_driver(server_store) as before:
        pass

    def meanwhile() -> None:
        raise ValueError("build failed")

    new = task_job()
    with pytest.raises(ValueError, match="build failed"):
        server_store.enqueue(
            new, to(State.DISPATCHED, State.SCHEDULED, rev=new.rev), meanwhile=meanwhile
        )
    job = server_store.get(new.ref)
    assert job is not None and job.state is State.DISPATCHED
    with pooled_driver(server_store) as after:
        assert after is before and not after.closed and pgwire.keeps(after)
