"""What the Django acceptance tests share: the project's database, and its beats.

:class:`DjangoDatabase` is one run's database (SQLite file or PostgreSQL
database), created and migrated as ``manage.py migrate`` does, reached from
the test process through the ORM (alias ``acceptance``) and from the beats and
workers as their ``default`` (``EXACTONCE_TEST_DJANGO_DB``,
:mod:`tests.django_tests.settings`). The ``django_database`` fixture gives it.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests import services
from tests.acceptance.harness import REPO_ROOT, BeatProcess, process_env
from tests.django_tests import routing
from tests.django_tests.settings import one_database

DJANGO_APP = "tests.acceptance.apps.django_app"


class DjangoBeat(BeatProcess):
    """``celery -A …django_app beat -S <scheduler>`` on the test's Django database."""

    def __init__(self, env: Mapping[str, str], directory: Path, name: str, scheduler: str):
        super().__init__(env, directory, name, app_module=DJANGO_APP)
        self.scheduler = scheduler

    @property
    def argv(self) -> list[str]:
        return self.celery(
            "beat", "-S", self.scheduler, "-s", str(self.schedule_path), "--loglevel", "INFO"
        )


class DjangoDatabase:
    """The database of one run: created, migrated as ``manage.py migrate`` does, dropped.

    The test process reaches it through the ORM as the alias ``acceptance``
    (every model routed there); the beats as their ``default``.
    """

    ALIAS = "acceptance"

    def __init__(self, kind: str, tmp_path: Path) -> None:
        self.kind = kind
        self.name = f"acc_{uuid.uuid4().hex[:10]}"
        where = tmp_path / "django.sqlite3" if kind == "sqlite" else self.name
        self.spec = f"{kind}:{where}"

    #: The PostgreSQL role of :meth:`env` with ``ddl=False``: rows, and no ``CREATE``.
    NO_DDL_ROLE = "exactonce_acc_no_ddl"

    def env(self, *, ddl: bool = True) -> dict[str, str]:
        """The environment of a process on this database.

        ``ddl=False`` (PostgreSQL): it connects as a role that may read and
        write rows but has no ``CREATE`` on the schema, so a process that runs
        DDL fails at once (on SQLite nothing is refused).
        """
        spec = self.spec
        if not ddl and self.kind == "postgres":
            spec = f"{spec}:{self.NO_DDL_ROLE}"
        return {
            "DJANGO_SETTINGS_MODULE": "tests.django_tests.settings",
            "EXACTONCE_TEST_DJANGO_DB": spec,
        }

    def create(self) -> None:
        if self.kind == "postgres":
            self._postgres(f'CREATE DATABASE "{self.name}"')
        elif self.kind == "mysql":
            self._mysql(f"CREATE DATABASE `{self.name}`")
        subprocess.run(
            [sys.executable, "-m", "django", "migrate", "--noinput", "-v", "0"],
            env=process_env(**self.env()),
            cwd=REPO_ROOT,
            check=True,
            timeout=120,
        )
        if self.kind == "postgres":
            self._grant_rows_only()
        from django.db import connections

        raw = one_database(self.spec)
        connections.settings[self.ALIAS] = connections.configure_settings(
            {"default": raw, self.ALIAS: dict(raw)}
        )[self.ALIAS]

    def drop(self) -> None:
        from django.db import connections

        if self.ALIAS in connections.settings:
            connections[self.ALIAS].close()
            with contextlib.suppress(AttributeError):
                del connections[self.ALIAS]
            del connections.settings[self.ALIAS]
        if self.kind == "postgres":
            self._postgres(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
        elif self.kind == "mysql":
            self._mysql(f"DROP DATABASE IF EXISTS `{self.name}`")

    def _grant_rows_only(self) -> None:
        """:data:`NO_DDL_ROLE` may use this database's rows (PostgreSQL 15+: no CREATE)."""
        import psycopg

        role = self.NO_DDL_ROLE
        with contextlib.suppress(psycopg.errors.DuplicateObject):
            self._postgres(f'CREATE ROLE "{role}" LOGIN')
        url = services.POSTGRES_URL.rsplit("/", 1)[0] + f"/{self.name}"
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f'GRANT CONNECT ON DATABASE "{self.name}" TO "{role}"')
            conn.execute(f'REVOKE CREATE ON SCHEMA public FROM PUBLIC, "{role}"')
            conn.execute(f'GRANT USAGE ON SCHEMA public TO "{role}"')
            conn.execute(
                f'GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO "{role}"'
            )
            conn.execute(f'GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO "{role}"')

    @staticmethod
    def _mysql(statement: str) -> None:
        import pymysql

        parts = urlsplit(services.MYSQL_URL)
        conn = pymysql.connect(
            host=parts.hostname or "127.0.0.1",
            port=parts.port or 3306,
            user=parts.username or "root",
            password=parts.password or "",
        )
        try:
            with conn.cursor() as cursor:
                cursor.execute(statement)
        finally:
            conn.close()

    @staticmethod
    def _postgres(statement: str) -> None:
        import psycopg

        with psycopg.connect(services.POSTGRES_URL, autocommit=True) as conn:
            conn.execute(statement)


@pytest.fixture(params=["sqlite", "postgres"])
def django_database(
    request: pytest.FixtureRequest, tmp_path: Path, django_db_blocker: Any
) -> Iterator[DjangoDatabase]:
    if request.param != "sqlite":
        services.need(request.param)
    database = DjangoDatabase(request.param, tmp_path)
    with django_db_blocker.unblock():
        database.create()
        routing.ALIAS = DjangoDatabase.ALIAS
        try:
            yield database
        finally:
            routing.ALIAS = "default"
            database.drop()
