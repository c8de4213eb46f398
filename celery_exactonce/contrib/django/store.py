"""The SQL store in a Django project's own database: ``exactonce_store_url = "django://ALIAS"``.

:class:`DjangoStore` is the :class:`~celery_exactonce.stores.sql.store.SqlStore`,
every statement and rule of it, run on Django's connection of ``ALIAS``
(``django://`` alone is ``default``) inside Django's transactions:

* each operation is one ``transaction.atomic(using=ALIAS)`` block: its own
  transaction, or a savepoint of the caller's when the caller is inside one,
  so a job written in a caller's ``transaction.atomic()`` commits or rolls
  back with the caller's rows. :meth:`DjangoStore.after_commit` is how
  :class:`~celery_exactonce.task.base.ExactOnceTask` publishes such a job only once
  the caller's transaction commits (the transactional submit);
* no DDL ever runs: the tables are the app's migrations'
  (``python manage.py migrate``); :meth:`DjangoStore.setup` checks they are
  there, at the schema version this code writes.

SQLAlchemy compiles the statements for the database's dialect and runs them
on Django's DB-API connection, which it borrows: it never commits, rolls back
or closes it, Django does. PostgreSQL (psycopg 3 or psycopg2), SQLite and
MySQL/MariaDB (mysqlclient, or PyMySQL installed as ``MySQLdb``) are
supported, as the SQL store supports them.

Not here: the statements and the rules (:mod:`celery_exactonce.stores.sql.store`),
the tables' migration (:mod:`celery_exactonce.contrib.django.migrations`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import sqlalchemy as sa

from celery_exactonce.contrib.django.connection import engine_for, require_immediate
from celery_exactonce.contrib.django.tables import prefix
from celery_exactonce.core import exceptions, jobs
from celery_exactonce.core.refs import process_id
from celery_exactonce.stores.sql import pgwire
from celery_exactonce.stores.sql import schema as sql_schema
from celery_exactonce.stores.sql.shared import driver_error
from celery_exactonce.stores.sql.store import SqlStore

_T = TypeVar("_T")


def alias_of(url: str) -> str:
    """``django://ALIAS`` → ``ALIAS`` (``default`` when it is empty)."""
    scheme, _, rest = url.partition("://")
    if scheme.lower() != "django":
        raise exceptions.ConfigurationError(
            f"exactonce_store_url={url!r} is not a django:// URL", setting="exactonce_store_url"
        )
    alias = rest.strip("/")
    return alias or "default"


class DjangoStore(SqlStore):
    """The SQL store on Django's connection ``alias``, inside Django's transactions.

    Parameters
    ----------
    alias
        A key of Django's ``DATABASES``.
    namespace, retention
        As for :class:`~celery_exactonce.stores.sql.store.SqlStore`. The tables are
        the ones the app's migrations made, with their prefix
        (:func:`celery_exactonce.contrib.django.tables.prefix`), whatever
        ``exactonce_table_prefix`` says.
    """

    owns_transactions = False

    def __init__(
        self,
        alias: str,
        *,
        namespace: str,
        retention: float,
        compaction: jobs.Compaction = jobs.KEEP,
    ) -> None:
        from django.conf import settings
        from django.db import Error, connections

        if "celery_exactonce.contrib.django" not in settings.INSTALLED_APPS:
            raise exceptions.ConfigurationError(
                f"exactonce_store_url='django://{alias}' needs 'celery_exactonce.contrib.django' "
                "in INSTALLED_APPS (its migrations make the store's tables)",
                setting="exactonce_store_url",
            )
        if alias not in connections:
            raise exceptions.ConfigurationError(
                f"exactonce_store_url='django://{alias}': no database {alias!r} in DATABASES "
                f"(known: {', '.join(connections)})",
                setting="exactonce_store_url",
            )
        require_immediate(alias, f"exactonce_store_url='django://{alias}'", "exactonce_store_url")
        # Held (not weakly): a thread's connection outlives the thread until it is closed.
        self._borrowed: set[Any] = set()
        super().__init__(
            engine_for(alias, self._borrowed),
            namespace=namespace,
            retention=retention,
            compaction=compaction,
            table_prefix=prefix(),
        )
        self.alias = alias
        self._where = f"django store {alias!r} ({self._engine.dialect.name})"
        self._driver_errors = (*self._driver_errors, Error)
        self._rerun_errors = (*self._rerun_errors, Error)  # Django's commit raises its own

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        namespace: str,
        retention: float,
        compaction: jobs.Compaction = jobs.KEEP,
        **_options: Any,
    ) -> DjangoStore:
        """The store of ``django://ALIAS``; Django's settings say how to connect."""
        return cls(alias_of(url), namespace=namespace, retention=retention, compaction=compaction)

    def setup(self) -> None:
        """Check the tables are there, at this code's schema version; never create them.

        Raises
        ------
        ConfigurationError
            The tables are missing: ``python manage.py migrate`` makes them.
        SchemaMismatch
            The tables are at another schema version.
        """
        version = self._run("setup", lambda conn: sql_schema.stored_version(conn, self._t))
        if version is None:
            raise exceptions.ConfigurationError(
                f"{self._where} has no celery-exactonce tables: run `python manage.py migrate`",
                setting="exactonce_store_url",
            )
        sql_schema.refuse_newer(version, self._where)
        if version < sql_schema.SCHEMA_VERSION:
            raise exceptions.SchemaMismatch(
                f"{self._where} holds schema version {version}; this celery-exactonce writes "
                f"version {sql_schema.SCHEMA_VERSION}: run `python manage.py migrate`"
            )
        missing = self._run("setup", self._missing_tables)
        if missing:
            raise exceptions.ConfigurationError(
                f"{self._where} lacks the celery-exactonce table(s) {', '.join(missing)}: "
                "run `python manage.py migrate`",
                setting="exactonce_store_url",
            )

    def _missing_tables(self, conn: sa.Connection) -> list[str]:
        """The tables a later migration made that the database lacks (its version unchanged)."""
        present = set(sa.inspect(conn).get_table_names())
        return [t.name for t in self._t.per_namespace if t.name not in present]

    def _attempt(self, fn: Callable[[sa.Connection], _T], *, write: bool, autocommit: bool) -> _T:
        """Run ``fn`` once in an ``atomic`` block: a transaction, or a savepoint of a caller's.

        With ``autocommit`` (``fn`` runs one statement, PostgreSQL) and no
        transaction open on the connection, the statement runs in Django's
        autocommit, as the SQL store runs it: no ``BEGIN`` or ``COMMIT``.
        """
        from django.db import connections, transaction

        if autocommit:
            connection = connections[self.alias]
            if not connection.in_atomic_block and connection.get_autocommit():
                with self._engine.connect() as conn:
                    return fn(conn)
        # In the gate's own transaction a savepoint would only cost round trips: an
        # operation that fails fails the run, which rolls back whole.
        own = self._in_own_transaction()
        with (
            transaction.atomic(using=self.alias, savepoint=not own),
            self._engine.connect() as conn,
        ):
            return fn(conn)

    def _in_own_transaction(self) -> bool:
        """Inside :meth:`transaction`, and in no savepoint the caller opened in it."""
        if not getattr(self._shared, "own", False):
            return False
        from django.db import connections

        return not connections[self.alias].savepoint_ids

    def _on_driver(self) -> bool:
        """A one-statement write runs on Django's driver connection in its autocommit, or
        in :meth:`transaction` (it commits with it)."""
        return self._commits_alone() or self._in_own_transaction()

    def _commits_alone(self) -> bool:
        """Whether a statement run alone commits at once: in Django's autocommit, outside
        any ``atomic`` block (a statement inside one commits with the caller's)."""
        from django.db import connections

        connection = connections[self.alias]
        return not connection.in_atomic_block and connection.get_autocommit()

    @contextlib.contextmanager
    def _statement_connection(self) -> Iterator[tuple[Any, bool]]:
        """Django's DB-API connection of this thread, in its autocommit: nothing to commit.

        Its own cursor runs the statement, as Django binds values on it
        (psycopg: client-side unless the project asks for server-side binding);
        on psycopg 3 a statement whose plan reads no table (a submit's
        ``INSERT``) is prepared once on the connection and keeps its plan
        (:mod:`~celery_exactonce.stores.sql.pgwire`).
        """
        from django.db import connections

        self._check_usable()
        connection = connections[self.alias]
        connection.ensure_connection()
        self._borrowed.add(connection)
        driver = connection.connection
        if self._postgresql:  # psycopg 3: the INSERT may keep a plan
            pgwire.allow(driver)
        try:
            yield driver, False
        except self._driver_errors as exc:
            raise driver_error(self._engine, exc) from exc

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Any]:
        """A transaction on this thread's connection of the alias (``transaction.atomic``),
        which it yields (Django's): every operation of this store made inside it is part
        of it, as are the caller's own queries (the atomic gate:
        :mod:`~celery_exactonce.task.atomic`)."""
        from django.db import connections, transaction

        with transaction.atomic(using=self.alias):
            self._shared.own = True
            try:
                yield connections[self.alias]
            finally:
                self._shared.own = False

    def after_commit(self) -> Callable[[Callable[[], None]], None] | None:
        """Inside a caller's transaction on this alias: how to run a function once it commits.

        ``None`` outside one (an operation commits at once). The function runs
        after the commit (``transaction.on_commit``, robust: an error in it is
        logged by Django and does not reach the committer), never after a
        rollback.
        """
        from django.db import connections, transaction

        if not connections[self.alias].in_atomic_block:
            return None
        alias = self.alias

        def register(fn: Callable[[], None]) -> None:
            transaction.on_commit(fn, using=alias, robust=True)

        return register

    def close(self) -> None:
        """Refuse later operations; close the Django connections it used, in every thread.

        Django closes a connection at the end of a request; the threads of a
        worker or a beat have none, so the store closes the connections it
        opened, as the SQL store disposes of its pool. One inside a
        transaction (a caller's ``atomic`` block) is left open.
        """
        super().close()
        borrowed, self._borrowed = list(self._borrowed), set()
        for connection in borrowed:
            if connection.in_atomic_block:
                continue
            connection.inc_thread_sharing()  # it may be another thread's
            try:
                connection.close()
            finally:
                connection.dec_thread_sharing()

    def _forget_pool(self) -> None:
        """Nothing pooled here: Django gives each process and thread its own connection."""
        self._pid = process_id()
