"""The Django tests' database: each test runs on SQLite and on PostgreSQL.

A test takes the ``alias`` fixture: pytest-django sets up that database (its
migrations run, as ``manage.py migrate`` would), every model is routed to it,
and a test on PostgreSQL needs the server (skipped locally when it is down,
failed under ``EXACTONCE_REQUIRE_SERVICES``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from celery_exactonce import store_from_url
from celery_exactonce.beat.scheduler import ExactOnceScheduler
from celery_exactonce.stores.base import StateStore
from tests import services
from tests.django_tests import routing

ALIASES = [
    pytest.param(
        "default", marks=pytest.mark.django_db(databases=["default"], transaction=True), id="sqlite"
    ),
    pytest.param(
        "postgres",
        marks=[
            pytest.mark.django_db(databases=["postgres"], transaction=True),
            pytest.mark.postgres,
        ],
        id="postgres",
    ),
]


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before any fixture (pytest-django would set the database up): is the server there?"""
    if item.get_closest_marker("postgres") is not None:
        services.need("postgres")
    if item.get_closest_marker("mysql") is not None:
        pytest.importorskip("MySQLdb", reason="Django's MySQL backend needs mysqlclient or PyMySQL")
        services.need("mysql")


#: MariaDB (``REPEATABLE READ``), for the tests that take it beside :data:`ALIASES`.
MYSQL = pytest.param(
    "mysql",
    marks=[pytest.mark.django_db(databases=["mysql"], transaction=True), pytest.mark.mysql],
    id="mysql",
)


def routed(alias: str) -> Iterator[str]:
    """``alias``, every model routed to it while the test runs (an ``alias`` fixture's body)."""
    routing.ALIAS = alias
    try:
        yield alias
    finally:
        routing.ALIAS = "default"


@pytest.fixture(params=ALIASES)
def alias(request: pytest.FixtureRequest) -> Iterator[str]:
    """The database of this test, every model routed to it."""
    yield from routed(request.param)


@pytest.fixture(autouse=True)
def _reconcile_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Beat nodes run their reconcile passes inside the tick: frozen clocks stay deterministic."""
    monkeypatch.setattr(ExactOnceScheduler, "reconcile_in_thread", False)


@pytest.fixture
def store(alias: str) -> Iterator[StateStore]:
    """A django:// store in a namespace of the test's own (Django flushes only its models)."""
    made = store_from_url(
        f"django://{alias}", namespace=f"t-{uuid.uuid4().hex[:8]}", retention=3600
    )
    made.setup()
    yield made
    made.drop_namespace()  # type: ignore[attr-defined]
    made.close()
