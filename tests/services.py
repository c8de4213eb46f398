"""Where the test services are, and what to do when one is down.

Locally a test that needs a service that does not answer is skipped, with the
reason shown (``-ra``). With ``EXACTONCE_REQUIRE_SERVICES=1`` (CI) it fails
instead: CI must never pass by skipping.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any
from urllib.parse import urlsplit

import pytest

REDIS_URL = os.environ.get("EXACTONCE_TEST_REDIS_URL", "redis://127.0.0.1:6379/9")
POSTGRES_URL = os.environ.get(
    "EXACTONCE_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
MYSQL_URL = os.environ.get("EXACTONCE_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")
AMQP_URL = os.environ.get("EXACTONCE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")

SERVICE_URLS = {
    "redis": REDIS_URL,
    "postgres": POSTGRES_URL,
    "mysql": MYSQL_URL,
    "rabbitmq": AMQP_URL,
}

_answers: dict[str, bool] = {}


def required() -> bool:
    return os.environ.get("EXACTONCE_REQUIRE_SERVICES", "") not in ("", "0", "false", "no")


def answers(service: str) -> bool:
    """Whether the service's port accepts a TCP connection (cached per run)."""
    if service not in _answers:
        parts = urlsplit(SERVICE_URLS[service])
        try:
            with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 0), 2):
                _answers[service] = True
        except OSError:
            _answers[service] = False
    return _answers[service]


def delete_redis_keys(url: str, pattern: str) -> None:
    """Delete every key matching ``pattern`` on the Redis at ``url`` (a test's own keys)."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=pattern, count=500))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def vacuum_postgres() -> bool:
    """``VACUUM ANALYZE`` the test database, if PostgreSQL answers; whether it ran.

    The tests create and delete many rows under fresh namespaces in shared
    tables. A server with autovacuum off (as this machine's is) keeps every
    dead row, run after run, in the tables and indexes every later run scans;
    vacuumed at the start, a run does not pay for the ones before it.
    """
    if not answers("postgres"):
        return False
    import psycopg

    with psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=5) as conn:
        _forget_namespace_statistics(conn)
        conn.execute("VACUUM ANALYZE")
    return True


def _forget_namespace_statistics(conn: Any) -> None:
    """Give jobs tables made before the store kept no key statistics the store's settings.

    A new store's jobs table keeps no statistics of ``namespace`` and ``space``
    (``stores.sql.schema.build``). The test database's older tables, analyzed while
    other test namespaces filled them, misled the planner into reading every
    job of a namespace per key: their settings are set and their old
    statistics dropped (as a superuser may; otherwise they are left).
    """
    import psycopg

    stale = conn.execute(
        "SELECT a.attrelid::regclass::text, a.attname FROM pg_attribute a"
        " JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = 'public' AND c.relkind = 'r' AND c.relname LIKE %s"
        " AND a.attname IN ('namespace', 'space') AND a.attstattarget <> 0",
        ("%jobs",),
    ).fetchall()
    for table, column in stale:
        conn.execute(f'ALTER TABLE {table} ALTER COLUMN "{column}" SET STATISTICS 0')
        with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
            conn.execute(
                "DELETE FROM pg_statistic WHERE starelid = %s::regclass AND staattnum ="
                " (SELECT attnum FROM pg_attribute WHERE attrelid = %s::regclass AND attname = %s)",
                (table, table, column),
            )


def need(service: str) -> None:
    """Skip (locally) or fail (CI) unless ``service`` answers."""
    if answers(service):
        return
    message = f"{service} does not answer at {SERVICE_URLS[service]}"
    if required():
        pytest.fail(f"{message} and EXACTONCE_REQUIRE_SERVICES is set", pytrace=False)
    pytest.skip(message)
