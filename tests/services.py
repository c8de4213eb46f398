"""Where the test services are, and what to do when one is down.

Locally a test that needs a service that does not answer is skipped, with the
reason shown (``-ra``). With ``EXACTONCE_REQUIRE_SERVICES=1`` (CI) it fails
instead: CI must never pass by skipping.
"""

from __future__ import annotations

import os
import socket
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
        conn.execute("VACUUM ANALYZE")
    return True


def need(service: str) -> None:
    """Skip (locally) or fail (CI) unless ``service`` answers."""
    if answers(service):
        return
    message = f"{service} does not answer at {SERVICE_URLS[service]}"
    if required():
        pytest.fail(f"{message} and EXACTONCE_REQUIRE_SERVICES is set", pytrace=False)
    pytest.skip(message)
