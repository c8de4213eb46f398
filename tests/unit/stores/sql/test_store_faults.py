"""SqlStore at its boundary: driver errors wrapped, schema versions, bad config refused.

SQLite files and unreachable ports only: no database server is needed.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_exactonce.core import exceptions
from celery_exactonce.core.jobs import CreateStatus
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.stores import store_from_url
from celery_exactonce.stores.base import StateStore
from celery_exactonce.stores.sql import schema as sql_schema
from celery_exactonce.stores.sql.store import SqlStore

PASSWORD = "s3cret-pw"


def _new(job_id: str = "j1") -> NewJob:
    return NewJob(JobRef.submitted(job_id), "tasks.add", State.SCHEDULED, node="n", args=(1,))


def _sqlite(path: Path, namespace: str = "faults", **kwargs: Any) -> SqlStore:
    return SqlStore.from_url(f"sqlite:///{path}", namespace=namespace, retention=60.0, **kwargs)


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "store.db"


@pytest.fixture
def store(db: Path) -> Iterator[SqlStore]:
    store = _sqlite(db)
    store.setup()
    yield store
    store.close()


def test_fits_the_protocol(store: SqlStore) -> None:
    typed: StateStore = store
    assert isinstance(typed, StateStore)


def test_store_from_url_builds_a_sql_store(db: Path) -> None:
    store = store_from_url(f"sqlite:///{db}", namespace="faults", retention=60.0)
    try:
        assert isinstance(store, SqlStore)
    finally:
        store.close()


def test_works_end_to_end_on_sqlite(store: SqlStore) -> None:
    epoch = store.epoch()
    new = _new()
    assert store.create(new, epoch=epoch).created
    result = store.transition(
        new.ref, Transition(State.DISPATCHED, frozenset({State.SCHEDULED}), node="n", reason="d")
    )
    assert result.applied and result.job is not None and result.job.dispatches == 1
    assert store.get(new.ref) == result.job
    assert store.create(new).status is CreateStatus.EXISTS


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql+psycopg://postgres:{PASSWORD}@127.0.0.1:1/test",
        f"mysql+pymysql://root:{PASSWORD}@127.0.0.1:1/test",
    ],
)
def test_refused_connection_is_unavailable_without_the_password(url: str) -> None:
    # Nothing listens on port 1: the connection is refused before any byte is sent
    store = SqlStore.from_url(url, namespace="faults", retention=60.0)
    try:
        for call in (store.now, store.setup, store.ping, lambda: store.get(JobRef.submitted("x"))):
            with pytest.raises(exceptions.StoreUnavailable) as info:
                call()
            assert isinstance(info.value.__cause__, sa.exc.OperationalError)
            assert PASSWORD not in str(info.value)
            assert "***" in str(info.value)
    finally:
        store.close()


def test_malformed_url_is_a_configuration_error_without_the_password() -> None:
    with pytest.raises(exceptions.ConfigurationError) as info:
        SqlStore.from_url(
            f"postgresql+psycopg://u:{PASSWORD}@host:notaport/db",
            namespace="faults",
            retention=60.0,
        )
    assert info.value.setting == "exactonce_store_url"
    assert PASSWORD not in str(info.value)


@pytest.mark.parametrize("prefix", ["", "a" * 33, "bad-prefix", "x;drop", "é"])
def test_table_prefix_is_validated(db: Path, prefix: str) -> None:
    with pytest.raises(exceptions.ConfigurationError) as info:
        _sqlite(db, table_prefix=prefix)
    assert info.value.setting == "exactonce_table_prefix"


def test_bad_namespace_and_retention_are_refused(db: Path) -> None:
    with pytest.raises(exceptions.ConfigurationError):
        _sqlite(db, namespace="no spaces")
    with pytest.raises(exceptions.ConfigurationError):
        SqlStore.from_url(f"sqlite:///{db}", namespace="ok", retention=0)


def test_newer_schema_version_is_a_schema_mismatch(store: SqlStore, db: Path) -> None:
    with store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE exactonce_schema SET version = 99"))
    other = _sqlite(db)
    try:
        with pytest.raises(exceptions.SchemaMismatch, match="99"):
            other.setup()
    finally:
        other.close()


def test_older_schema_version_is_upgraded_step_by_step(
    store: SqlStore, db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps: list[int] = []
    monkeypatch.setitem(sql_schema.UPGRADES, 0, lambda conn, tables: steps.append(0))
    with store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE exactonce_schema SET version = 0"))
    store.setup()
    assert steps == [0]
    with store.engine.connect() as conn:
        version = conn.execute(sa.text("SELECT version FROM exactonce_schema")).scalar_one()
    assert version == sql_schema.SCHEMA_VERSION


def test_setup_is_idempotent_and_safe_in_parallel(db: Path) -> None:
    stores = [_sqlite(db) for _ in range(8)]
    errors: list[BaseException] = []

    def run(store: SqlStore) -> None:
        try:
            store.setup()
            store.setup()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    try:
        assert not errors
        assert stores[0].create(_new()).created
    finally:
        for s in stores:
            s.close()


def test_missing_tables_are_a_store_error_not_unavailable(db: Path) -> None:
    store = _sqlite(db)  # no setup()
    try:
        with pytest.raises(exceptions.StoreError) as info:
            store.get(JobRef.submitted("x"))
        assert not isinstance(info.value, exceptions.StoreUnavailable)
        assert isinstance(info.value.__cause__, sa.exc.OperationalError)
    finally:
        store.close()


def test_a_held_write_lock_is_unavailable_after_bounded_retries(db: Path) -> None:
    store = _sqlite(db, connect_args={"timeout": 0.05})
    store.setup()
    blocker = sqlite3.connect(db, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(exceptions.StoreUnavailable, match="locked"):
            store.create(_new())
        # Reads do not take the write lock (WAL): they still answer
        assert store.get(JobRef.submitted("j1")) is None
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert store.create(_new()).created
    store.close()


def test_closed_store_refuses_work(store: SqlStore) -> None:
    store.close()
    with pytest.raises(exceptions.StoreError, match="closed"):
        store.now()
    with pytest.raises(exceptions.StoreError, match="closed"):
        store.claim_due(0, node="n")


def test_a_forked_child_drops_the_inherited_pool(store: SqlStore) -> None:
    # Simulate a fork: the pid no longer matches, so the pool is replaced (not closed)
    store.now()
    pool = store.engine.pool
    store._pid = -1
    store.now()
    assert store.engine.pool is not pool


def test_drop_namespace_forgets_everything_of_its_namespace_only(db: Path) -> None:
    mine, theirs = _sqlite(db, "mine"), _sqlite(db, "theirs")
    mine.setup()
    try:
        epoch = mine.epoch()
        theirs_epoch = theirs.epoch()
        mine.create(_new())
        theirs.create(_new())
        assert mine.acquire_lease("reconcile", "tok", 60)
        mine.drop_namespace()
        assert mine.get(JobRef.submitted("j1")) is None
        assert mine.create(_new(), epoch=epoch).status is CreateStatus.EPOCH_MISMATCH
        assert mine.acquire_lease("reconcile", "other", 60)
        assert theirs.get(JobRef.submitted("j1")) is not None
        assert theirs.epoch() == theirs_epoch
    finally:
        mine.close()
        theirs.close()
