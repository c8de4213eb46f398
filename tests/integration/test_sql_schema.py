"""Schema version 2 of the SQL store: a version-1 database upgrades in place, at once from
two processes, and on PostgreSQL each scan reads its rows through its partial index.

Version 1 indexed every job row on ``(namespace, state, touched_at)``,
``(namespace, state, run_at)`` and ``(namespace, expires_at)``; version 2
(``stores/sql/schema.py``, :func:`job_indexes`) has partial indexes on
PostgreSQL and ``jobs_states`` + ``jobs_due`` elsewhere, purges terminal
records through the state index and writes a compacted payload as ``''``.
Each test has a table prefix of its own, dropped at the end.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_exactonce.core import exceptions
from celery_exactonce.core.jobs import Compaction
from celery_exactonce.core.states import State
from celery_exactonce.stores import store_from_url
from celery_exactonce.stores.sql import schema
from celery_exactonce.stores.sql.store import SqlStore
from tests import services
from tests.support.backends import store_url
from tests.support.helpers import poll, task_job, to

BACKENDS = ("sqlite", "postgres", "mysql")
V1_INDEXES = {"jobs_stale", "jobs_due", "jobs_expiry"}
V2_INDEXES = {
    "postgresql": {"jobs_live", "jobs_ended", "jobs_pending"},
    "mysql": {"jobs_states", "jobs_due"},
    "sqlite": {"jobs_states", "jobs_due"},
}


@pytest.fixture(params=BACKENDS)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param != "sqlite":
        services.need(request.param)
    return store_url(request.param, str(tmp_path))


@pytest.fixture
def prefix(url: str) -> Iterator[str]:
    name = f"v{uuid.uuid4().hex[:8]}_"
    yield name
    store = _store(url, name)
    try:
        schema.build(name).metadata.drop_all(store.engine)
    finally:
        store.close()


def _engine(url: str) -> sa.Engine:
    """An engine of ``url`` as the store makes one (its driver, its options)."""
    return _store(url, "unused_").engine  # disposed by the test


def _store(url: str, prefix: str, retention: float = 3600.0, **options: Any) -> SqlStore:
    store = store_from_url(
        url, namespace="default", table_prefix=prefix, retention=retention, **options
    )
    assert isinstance(store, SqlStore)
    return store


def _make_v1(url: str, prefix: str) -> sa.Engine:
    """The tables as version 1 made them: its three indexes over every row, version 1."""
    engine = _engine(url)
    with engine.begin() as conn:
        tables = schema.build(prefix, mysql_collation=schema.mysql_collation(conn.dialect))
        jobs = tables.jobs
        jobs.indexes.clear()
        c = jobs.c
        sa.Index(f"{prefix}jobs_stale", c.namespace, c.state, c.touched_at)
        sa.Index(f"{prefix}jobs_due", c.namespace, c.state, c.run_at)
        sa.Index(f"{prefix}jobs_expiry", c.namespace, c.expires_at)
        tables.metadata.create_all(conn)
        conn.execute(tables.schema.insert().values(id=1, version=1))
    return engine


def _indexes(engine: sa.Engine, prefix: str) -> set[str]:
    with engine.connect() as conn:
        names = {ix["name"] for ix in sa.inspect(conn).get_indexes(f"{prefix}jobs")}
    return {str(n).removeprefix(prefix) for n in names}


def _version(engine: sa.Engine, prefix: str) -> int | None:
    with engine.connect() as conn:
        return schema.stored_version(conn, schema.build(prefix))


def _ended(store: SqlStore, name: str) -> Any:
    """A job of ``store`` made ``SUCCEEDED`` (a finished gated run)."""
    new = task_job(name)
    store.create(new)
    store.transition(new.ref, to(State.DISPATCHED, State.SCHEDULED))
    store.transition(new.ref, to(State.RUNNING, State.DISPATCHED, attempt=0, new_run_id="r1"))
    return store.transition(new.ref, to(State.SUCCEEDED, State.RUNNING, run_id="r1")).job


def test_a_version_1_database_is_upgraded_in_place(url: str, prefix: str) -> None:
    # Given a database version 1 made
    engine = _make_v1(url, prefix)
    assert _indexes(engine, prefix) == V1_INDEXES
    old = _store(url, prefix, retention=0.01)
    try:
        # When a process of version 2 sets the store up
        old.setup()
        # Then the database is at version 2, with version 2's indexes only
        dialect = engine.dialect.name
        assert _version(engine, prefix) == schema.SCHEMA_VERSION == 2
        assert _indexes(engine, prefix) == V2_INDEXES[dialect]
        # and the store works on it: a job created, finished, listed and purged
        done = _ended(old, "a")
        assert [j.ref for j in old.list_stale(State.SUCCEEDED, 0, 10)] == [done.ref]
        assert _poll_purged(old) == 1
        # and setting it up again changes nothing
        old.setup()
        assert _indexes(engine, prefix) == V2_INDEXES[dialect]
    finally:
        old.close()
        engine.dispose()


def _poll_purged(store: SqlStore) -> int:
    purged: list[int] = []
    poll(lambda: purged.append(store.purge_expired(10)) or purged[-1] > 0)
    return purged[-1]


def test_two_processes_upgrade_a_version_1_database_at_once(url: str, prefix: str) -> None:
    # Given a version-1 database and two processes starting together
    engine = _make_v1(url, prefix)
    stores = [_store(url, prefix) for _ in range(2)]
    barrier, errors = threading.Barrier(2), []

    def start(store: SqlStore) -> None:
        try:
            barrier.wait()
            store.setup()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(s,)) for s in stores]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        # Then both started, and the database is at version 2 once, with its indexes
        assert errors == []
        assert _version(engine, prefix) == 2
        assert _indexes(engine, prefix) == V2_INDEXES[engine.dialect.name]
    finally:
        for store in stores:
            store.close()
        engine.dispose()


def test_a_version_1_process_refuses_a_version_2_database(
    url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a database set up by this version
    store = _store(url, prefix)
    try:
        store.setup()
    finally:
        store.close()
    # When a process of version 1 sets it up, it refuses: every process must be upgraded
    monkeypatch.setattr(schema, "SCHEMA_VERSION", 1)
    old = _store(url, prefix)
    try:
        with pytest.raises(exceptions.SchemaMismatch, match="schema version 2"):
            old.setup()
    finally:
        old.close()


def test_downgrade_then_upgrade_keeps_compacted_records_readable(url: str, prefix: str) -> None:
    # Given a compacted terminal record, its payload written as ''
    store = _store(url, prefix, compaction=Compaction(history="none", payload=False))
    engine = _engine(url)
    try:
        store.setup()
        done = _ended(store, "c")
        jobs = store._t.jobs
        select = sa.select(jobs.c.payload).where(jobs.c.id == done.ref.id)
        with engine.connect() as conn:
            assert conn.execute(select).scalar_one() == ""
        assert store.get(done.ref) == done
        assert done.args == [] and done.options == {}
        # When the schema goes back to version 1 (Django's migration backwards)
        with engine.begin() as conn:
            schema.downgrade_to_1(conn, store._t)
        # Then version 1 reads its payload as it wrote one, and its indexes are back
        assert _version(engine, prefix) == 1
        assert _indexes(engine, prefix) == V1_INDEXES
        with engine.connect() as conn:
            assert conn.execute(select).scalar_one() == schema.V1_COMPACT_PAYLOAD
        # and upgrading again reads the same record
        store.setup()
        assert _indexes(engine, prefix) == V2_INDEXES[engine.dialect.name]
        assert store.get(done.ref) == done
    finally:
        store.close()
        engine.dispose()


# -- PostgreSQL: every scan reads its partial index ------------------------------------


@pytest.fixture
def pg(tmp_path: Path) -> Iterator[SqlStore]:
    services.need("postgres")
    prefix = f"v{uuid.uuid4().hex[:8]}_"
    store = _store(store_url("postgres", str(tmp_path)), prefix, retention=3600.0)
    store.setup()
    yield store
    try:
        store._t.metadata.drop_all(store.engine)
    finally:
        store.close()


def _plans(store: SqlStore, run: Any) -> list[str]:
    """The plans (``enable_seqscan`` off: an index the statement cannot use shows as a
    sequential scan anyway) of the ``SELECT`` statements ``run`` sends."""
    sent: list[tuple[str, Any]] = []

    def record(_conn: Any, _cursor: Any, statement: str, params: Any, *_: Any) -> None:
        if statement.lstrip().startswith("SELECT") and "_jobs" in statement:
            sent.append((statement, params))

    sa.event.listen(store.engine, "before_cursor_execute", record)
    try:
        run()
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", record)
    plans = []
    with store.engine.connect() as conn:
        conn.exec_driver_sql("SET enable_seqscan = off")
        for statement, params in sent:
            rows = conn.exec_driver_sql(f"EXPLAIN {statement}", params).scalars()
            plans.append("\n".join(rows))
    return plans


def test_postgres_scans_read_their_partial_indexes(pg: SqlStore) -> None:
    p = pg._t.prefix
    pg.create(task_job("live"))
    pg.create(task_job("later", State.PENDING, run_at=pg.now() - timedelta(seconds=5)))
    _ended(pg, "done")
    cases = {
        f"{p}jobs_live": lambda: pg.list_stale(State.SCHEDULED, 0, 10),
        f"{p}jobs_ended": lambda: (pg.list_stale(State.SUCCEEDED, 0, 10), pg.purge_expired(10)),
        f"{p}jobs_pending": lambda: (pg.claim_due(10, node="n1"), pg.due_backlog()),
    }
    counts = _plans(pg, pg.count_by_state)
    assert len(counts) == 2
    assert f"{p}jobs_live" in counts[0] and f"{p}jobs_ended" in counts[1], counts
    for index, run in cases.items():
        plans = _plans(pg, run)
        assert plans, index
        for plan in plans:
            assert index in plan and "Seq Scan" not in plan, plan
