"""SqlStore against real servers: what only the SQL store has.

Pooled connections checked without a round trip, and MySQL's pool reset.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from celery_exactonce.states import State
from celery_exactonce.stores.sql import SqlStore
from tests import services
from tests.contract.backends import store_url
from tests.contract.helpers import poll, task_job, to

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
