"""The Django app: its migration makes the store's tables; the django:// store runs no DDL."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from celery_exactonce import store_from_url
from celery_exactonce.contrib.django import tables
from celery_exactonce.contrib.django.store import DjangoStore
from celery_exactonce.core import exceptions
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.stores.sql.schema import SCHEMA_VERSION

TABLES = {
    "exactonce_jobs",
    "exactonce_watermarks",
    "exactonce_leases",
    "exactonce_unique",
    "exactonce_meta",
    "exactonce_skipped",
}


@pytest.fixture
def statements(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every SQL statement the stores built from now on send."""
    from celery_exactonce.contrib.django import connection

    sent: list[str] = []
    real = connection.engine_for

    def recording(*args: Any, **kwargs: Any) -> sa.Engine:
        engine = real(*args, **kwargs)
        sa.event.listen(
            engine, "before_cursor_execute", lambda *a: sent.append(str(a[2]).strip()), named=False
        )
        return engine

    monkeypatch.setattr("celery_exactonce.contrib.django.store.engine_for", recording)
    yield sent


def test_migrate_makes_the_stores_tables_at_its_schema_version(alias: str) -> None:
    from django.db import connections

    found = set(connections[alias].introspection.table_names())
    assert {*TABLES, "exactonce_schema"} <= found
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT version FROM exactonce_schema WHERE id = 1")
        assert cursor.fetchone() == (SCHEMA_VERSION,)


def test_the_django_store_runs_no_ddl_and_takes_jobs(alias: str, statements: list[str]) -> None:
    store = store_from_url(f"django://{alias}", namespace="app-test", retention=60)
    assert isinstance(store, DjangoStore)
    store.setup()
    created = store.create(NewJob(JobRef.submitted("a"), "t.add", State.SCHEDULED, node="n"))
    assert created.job is not None
    assert store.get(JobRef.submitted("a")).state is State.SCHEDULED  # type: ignore[union-attr]
    store.close()
    assert statements, "the recorder saw nothing"
    ddl = [s for s in statements if s.split()[0].upper() in ("CREATE", "ALTER", "DROP")]
    assert ddl == []


def test_without_the_migration_setup_says_to_run_it(alias: str) -> None:
    from django.core.management import call_command

    call_command("migrate", "celery_exactonce", "zero", database=alias, verbosity=0)
    try:
        store = DjangoStore(alias, namespace="app-test", retention=60)
        with pytest.raises(exceptions.ConfigurationError, match=r"run `python manage\.py migrate`"):
            store.setup()
        store.close()
    finally:
        call_command("migrate", "celery_exactonce", database=alias, verbosity=0)


def test_a_database_behind_the_last_migration_says_to_run_it(alias: str) -> None:
    from django.core.management import call_command

    call_command("migrate", "celery_exactonce", "0005", database=alias, verbosity=0)
    try:
        store = DjangoStore(alias, namespace="app-test", retention=60)
        missing = r"lacks the celery-exactonce table\(s\) exactonce_unique: run `python manage"
        with pytest.raises(exceptions.ConfigurationError, match=missing):
            store.setup()
        store.close()
    finally:
        call_command("migrate", "celery_exactonce", database=alias, verbosity=0)


def test_the_store_needs_the_app_installed_and_a_known_alias(alias: str) -> None:
    from django.test import override_settings

    needs_the_app = pytest.raises(exceptions.ConfigurationError, match=r"needs 'celery_exactonce\.")
    with override_settings(INSTALLED_APPS=["django_celery_beat"]), needs_the_app:
        DjangoStore(alias, namespace="n", retention=60)
    with pytest.raises(exceptions.ConfigurationError, match="no database 'nowhere' in DATABASES"):
        store_from_url("django://nowhere", namespace="n", retention=60)


@pytest.mark.django_db(databases=["default"], transaction=True)
def test_sqlite_needs_immediate_transactions() -> None:
    from django.db import connections

    alias = "default"  # SQLite
    assert connections[alias].vendor == "sqlite"
    options = connections[alias].settings_dict["OPTIONS"]
    mode = options.pop("transaction_mode")
    try:
        immediate = r"\['transaction_mode'\] = 'IMMEDIATE'"
        with pytest.raises(exceptions.ConfigurationError, match=immediate):
            DjangoStore(alias, namespace="n", retention=60)
    finally:
        options["transaction_mode"] = mode


def test_the_tables_prefix_is_a_django_setting() -> None:
    from django.test import override_settings

    assert tables.prefix() == "exactonce_"
    with override_settings(EXACTONCE_TABLE_PREFIX="jobs_"):
        assert tables.prefix() == "jobs_"
