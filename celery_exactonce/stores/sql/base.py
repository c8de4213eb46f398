"""What every operation of the SQL store stands on: its state, its transactions, its rows.

:class:`SqlCore` is the base of :class:`~celery_exactonce.stores.sql.store.SqlStore`
and of its mixins. It holds what the constructor checks and builds (the dialect,
the tables, the statements, the redacted place named in errors), and:

* **transactions**: :meth:`SqlCore._run` runs one operation as one database
  transaction, retried as a whole, bounded and with jittered backoff, after a
  deadlock, a serialization failure, a lock-wait timeout or SQLite's "database is
  locked" (rolled back: running it again is safe), or after :class:`Rerun`;
  :meth:`SqlCore._guard` turns driver errors into ``StoreUnavailable``
  (retrying later may help) or ``StoreError``, secrets blanked;
* **fork safety**: a store must not be shared across ``fork()``; each process builds
  its own. As a safety net (SQLAlchemy's recipe), a forked child drops the pool it
  inherited (``engine.dispose(close=False)``) before its first query;
* **rows**: the store clock, reading a record by its key (locked or not), a row
  under a lock, inserting a row unless its key exists (values: ``sql.rows``).

Not here: the operations (:mod:`~celery_exactonce.stores.sql.store` and its mixins),
the dialects and the engine (:mod:`~celery_exactonce.stores.sql.engine`).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from celery_exactonce.core import exceptions, jobs
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef, process_id
from celery_exactonce.stores import redact_secrets, url_secrets, validate_namespace
from celery_exactonce.stores.base import Run
from celery_exactonce.stores.sql import engine as sql_engine
from celery_exactonce.stores.sql import pgwire
from celery_exactonce.stores.sql import rows as sql_rows
from celery_exactonce.stores.sql import schema as sql_schema
from celery_exactonce.stores.sql import statements_batch as sql_statements_batch

_T = TypeVar("_T")
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_]{1,32}$")
_ATTEMPTS = 8
"""Runs of one transaction at most (the first and the retries)."""
_BACKOFF = 0.005
"""Seconds; the n-th retry sleeps up to ``_BACKOFF * 2**n`` (full jitter)."""


class Rerun(Exception):
    """Raised inside a transaction to roll it back and run it again."""


class Slow(Exception):
    """A one-statement write failed whole (nothing written): run the locking transaction."""


_LIVE: weakref.WeakSet[SqlCore] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for store in list(_LIVE):
        store._forget_pool()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class SqlCore:
    """The state of a SQL store, its transactions and its row helpers.

    The arguments are those of :class:`~celery_exactonce.stores.sql.store.SqlStore`.
    """

    #: Whether the store begins and ends its own transactions on the engine's
    #: connections (SQLite: ``BEGIN IMMEDIATE``). The Django store runs inside
    #: Django's transactions instead.
    owns_transactions = True
    #: Errors after which :meth:`_run` runs the transaction again, when the driver's
    #: code says the database rolled it back (a deadlock, a lock wait, "locked").
    _rerun_errors: tuple[type[BaseException], ...] = (sa_exc.DBAPIError,)

    def __init__(
        self,
        engine: sa.Engine,
        *,
        namespace: str,
        retention: float,
        table_prefix: str = "exactonce_",
        compaction: jobs.Compaction = jobs.KEEP,
    ) -> None:
        validate_namespace(namespace)
        if not isinstance(table_prefix, str) or not _PREFIX_RE.match(table_prefix):
            raise exceptions.ConfigurationError(
                f"exactonce_table_prefix={table_prefix!r}: 1-32 letters, digits or '_'",
                setting="exactonce_table_prefix",
            )
        if retention <= 0:
            raise exceptions.ConfigurationError(
                "exactonce_retention must be > 0", setting="exactonce_retention"
            )
        dialect = sql_engine.DIALECTS.get(engine.dialect.name)
        if dialect is None:
            raise exceptions.ConfigurationError(
                f"no SQL store for the {engine.dialect.name!r} dialect "
                f"(expected one of {', '.join(sorted(sql_engine.DIALECTS))})",
                setting="exactonce_store_url",
            )
        self._engine = engine
        self._d = dialect
        self._postgresql = engine.dialect.name == "postgresql"
        # PostgreSQL runs a one-statement write outside a transaction (autocommit: no
        # BEGIN and COMMIT round trips; psycopg switches it locally). PyMySQL would
        # pay a round trip to switch, so MySQL commits (no BEGIN is sent there).
        self._autocommit = self._postgresql
        self._namespace = namespace
        self._retention = float(retention)
        self._t = sql_schema.build(table_prefix)
        self._now_col = sa.literal_column(dialect.now, sa.BigInteger)
        self._inserts: dict[str, Any] = {}  # per table, see _insert_absent
        self._raw_sql: dict[Any, tuple[str, tuple[str, ...] | None]] = {}  # _run_statement's
        self._compaction = compaction
        self._sql = sql_statements_batch.BatchStatements(
            engine.dialect, self._t, dialect.now, retention, compaction=compaction
        )
        # Reading a record by its key: built once (building and keying a select per read
        # cost more than the read), the key bound at execute time.
        c = self._t.jobs.c
        self._read = sa.select(self._t.jobs).where(
            c.namespace == sa.bindparam("k_ns"),
            c.space == sa.bindparam("k_space"),
            c.id == sa.bindparam("k_id"),
        )
        self._read_locked = self._read.with_for_update()
        self._read_current = self._read.with_for_update(read=True)  # see _select_existing
        # The URL may carry credentials in its query too (``?password=``): redact
        # the whole of it, and remember every secret to blank from driver errors.
        full_url = engine.url.render_as_string(hide_password=False)
        self._where = f"{engine.dialect.name} store {sql_engine.shown_url(engine.url)}"
        password = engine.url.password
        self._secrets: list[str] = [*url_secrets(full_url), *([str(password)] if password else [])]
        dbapi = getattr(engine.dialect, "dbapi", None)
        self._driver_errors: tuple[type[BaseException], ...] = (
            (dbapi.Error,) if dbapi is not None and hasattr(dbapi, "Error") else ()
        )
        self._owns_engine = False
        self._closed = False
        self._pid = process_id()
        if engine.dialect.name == "sqlite" and self.owns_transactions:
            sql_engine.install_sqlite_listeners(engine)
        _LIVE.add(self)

    # -- transactions and errors -------------------------------------------------------

    def _run(
        self,
        op: str,
        fn: Callable[[sa.Connection], _T],
        *,
        write: bool = True,
        autocommit: bool = False,
    ) -> _T:
        """Run ``fn`` in one transaction, rerun after a rolled-back conflict, errors wrapped.

        With ``autocommit`` (PostgreSQL, ``fn`` running one statement), the
        statement is its own transaction: no ``BEGIN`` or ``COMMIT`` is sent.
        """
        with self._guard(op):
            self._check_usable()
            for attempt in range(_ATTEMPTS):
                try:
                    return self._attempt(fn, write=write, autocommit=autocommit)
                except Rerun:
                    if attempt + 1 == _ATTEMPTS:
                        raise exceptions.StoreUnavailable(
                            f"{op} on {self._where}: kept racing with concurrent writers"
                        ) from None
                except self._rerun_errors as exc:
                    # SQLAlchemy's errors hold the driver's in ``orig``; others chain it.
                    orig = getattr(exc, "orig", None) or exc.__cause__ or exc
                    if attempt + 1 == _ATTEMPTS or sql_engine.error_code(orig) not in self._d.retry:
                        raise
                # Full jitter: concurrent losers do not retry in lockstep.
                time.sleep(random.uniform(0, _BACKOFF * 2**attempt))  # noqa: S311 (not crypto)
        raise AssertionError("unreachable")  # pragma: no cover

    def _attempt(self, fn: Callable[[sa.Connection], _T], *, write: bool, autocommit: bool) -> _T:
        """Run ``fn`` once, in a transaction of its own (``autocommit``: none, see :meth:`_run`)."""
        with self._engine.connect() as conn:
            if autocommit:
                conn.execution_options(isolation_level="AUTOCOMMIT")
            elif not write:
                conn.execution_options(**{sql_engine.READ: True})
            with conn.begin():
                return fn(conn)

    def _run_statement(
        self,
        op: str,
        stmt: sa.TextClause | sa.TextualSelect,
        params: dict[str, Any],
        meanwhile: Run = None,
        keep: pgwire.Settings | None = None,
    ) -> Any:
        """Run one write alone, committed, on a DB-API connection: its first row.

        The hot path's one-statement writes (``enqueue``, the gate's brief
        transitions), compiled once: SQLAlchemy's objects cost more than the
        round trip. PostgreSQL runs it in autocommit, SQLite in the autocommit
        its connections are in, MySQL commits it (in the same message where it
        can: :func:`~.engine.commits_in_statement`). ``()``: no ``RETURNING``;
        ``None``: no row, or (MySQL) its key exists. Errors are wrapped as every
        other (:meth:`_guard`), the connection dropped if it broke. Not retried:
        a statement alone locks at most its one row, so it cannot deadlock; an ``INSERT``
        waits on no lock but its key's. ``meanwhile``, ``keep``: :func:`~.engine.execute`.
        """
        sql, keys = self._compiled(stmt)
        values = params if keys is None else tuple(params[key] for key in keys)
        with self._guard(op), self._statement_connection() as (driver, commit):
            ends = commit and sql_engine.commits_in_statement(driver)  # MySQL: its COMMIT too
            try:
                text = sql + sql_engine.COMMITS if ends else sql
                rows = sql_engine.execute(driver, text, values, meanwhile, drain=ends, keep=keep)
            except self._driver_errors as exc:
                if sql_engine.error_code(exc) != sql_engine.DUPLICATE_KEY:
                    raise
                rows = []  # MySQL: the key exists (its transaction is rolled back below)
            if commit and rows == []:  # MySQL's duplicate key: its transaction is let go
                driver.rollback()
            elif commit and not ends:
                driver.commit()
            return () if rows is None else (rows[0] if rows else None)

    def _compiled(self, stmt: Any) -> tuple[str, tuple[str, ...] | None]:
        """``stmt``'s text for the driver and (a positional driver) its parameters' order."""
        compiled = self._raw_sql.get(stmt)
        if compiled is None:
            done = stmt.compile(dialect=self._engine.dialect)
            keys = tuple(done.positiontup or ()) if done.positional else None
            compiled = self._raw_sql[stmt] = (str(done), keys)
        return compiled

    @contextlib.contextmanager
    def _statement_connection(self) -> Iterator[tuple[Any, bool]]:
        """A pooled DB-API connection for :meth:`_run_statement`, and whether to commit.

        The pool checks it out (its checkout check included) and takes it
        back. A driver error leaves as SQLAlchemy would raise it, the
        connection dropped from the pool if it broke.
        """
        self._check_usable()
        raw = self._engine.raw_connection()
        driver: Any = raw.driver_connection
        try:
            if self._postgresql:
                driver.autocommit = True  # psycopg: local, no round trip while idle
            try:
                yield driver, self._engine.dialect.name == "mysql"
            except self._driver_errors as exc:
                dialect = self._engine.dialect
                broken = dialect.is_disconnect(exc, driver, None)  # type: ignore[arg-type]
                if broken:
                    raw.invalidate(exc)
                elif dialect.name == "mysql":  # PyMySQL: no transaction status after an error
                    with contextlib.suppress(*self._driver_errors):
                        driver.rollback()
                raise sa_exc.DBAPIError.instance(
                    None, None, exc, dialect.loaded_dbapi.Error, connection_invalidated=broken
                ) from exc
            finally:
                if self._postgresql and not driver.closed:
                    driver.autocommit = False
        finally:
            raw.close()  # back to the pool

    def _run_idempotent(self, op: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` (idempotent, no one transaction) under the guard, again while unavailable."""
        for attempt in range(_ATTEMPTS):
            try:
                with self._guard(op):
                    self._check_usable()
                    fn()
                return
            except exceptions.StoreUnavailable:
                if attempt + 1 == _ATTEMPTS:
                    raise
                time.sleep(random.uniform(0, _BACKOFF * 2**attempt))  # noqa: S311 (not crypto)

    @contextlib.contextmanager
    def _guard(self, op: str) -> Iterator[None]:
        """Wrap driver errors: StoreUnavailable when retrying may help, else StoreError."""
        wrapped: tuple[type[BaseException], ...] = (
            sa_exc.SQLAlchemyError,
            OSError,
            *self._driver_errors,
        )
        try:
            yield
        except exceptions.ExactOnceError:
            raise
        except wrapped as exc:
            orig = getattr(exc, "orig", None) or exc
            code = sql_engine.error_code(orig)
            transient = (
                code in self._d.retry
                or isinstance(exc, (sa_exc.TimeoutError, sa_exc.DisconnectionError, OSError))
                or (isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated)
                or (
                    isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError))
                    and (self._d.unavailable is None or code in self._d.unavailable)
                )
            )
            detail = (str(orig).strip().splitlines() or [""])[0]
            message = redact_secrets(
                f"{op} on {self._where} failed: {type(orig).__name__}: {detail}", self._secrets
            )
            cls = exceptions.StoreUnavailable if transient else exceptions.StoreError
            raise cls(message) from exc

    def _check_usable(self) -> None:
        if self._closed:
            raise exceptions.StoreError("the store is closed")
        if process_id() != self._pid:
            self._forget_pool()

    def _mark_closed(self) -> None:
        """Refuse every later operation; a fork no longer concerns this store."""
        self._closed = True
        _LIVE.discard(self)

    def _forget_pool(self) -> None:
        """In a forked child: drop the parent's pooled connections without closing them."""
        self._engine.dispose(close=False)
        self._pid = process_id()

    def _empty(self, value: _T) -> _T:
        """The answer to a request for nothing (``limit <= 0``), once the store is checked."""
        self._check_usable()
        return value

    # -- rows --------------------------------------------------------------------------

    def _now(self, conn: sa.Connection) -> int:
        return int(conn.execute(sa.select(self._now_col)).scalar_one())

    def _pk(self, ref: JobRef) -> sa.ColumnElement[bool]:
        c = self._t.jobs.c
        return sa.and_(c.namespace == self._namespace, c.space == ref.space.value, c.id == ref.id)

    def _select_job(self, conn: sa.Connection, ref: JobRef, *, lock: bool = False) -> Job | None:
        query = self._read_locked if lock and self._d.locks else self._read
        params = {"k_ns": self._namespace, "k_space": ref.space.value, "k_id": ref.id}
        row = conn.execute(query, params).first()
        return None if row is None else self._job(row)

    def _select_existing(self, conn: sa.Connection, ref: JobRef) -> Job | None:
        """The record whose key an insert just met: committed, if not in this snapshot.

        MySQL at ``REPEATABLE READ`` reads the transaction's snapshot, taken at
        its first read: a record another transaction committed since is not in
        it, though its key refuses the insert. Running the transaction again
        takes a new snapshot, but not inside a caller's transaction (the
        ``django://`` store in ``transaction.atomic()``). A shared-lock read
        sees the committed record; it is made only when the plain read misses.
        """
        found = self._select_job(conn, ref)
        if found is not None or self._engine.dialect.name != "mysql":
            return found
        params = {"k_ns": self._namespace, "k_space": ref.space.value, "k_id": ref.id}
        row = conn.execute(self._read_current, params).first()
        return None if row is None else self._job(row)

    def _locked(
        self, conn: sa.Connection, table: sa.Table, where: tuple[sa.ColumnElement[bool], ...]
    ) -> sa.Row[Any] | None:
        query = sa.select(table).where(*where)
        if self._d.locks:
            query = query.with_for_update()
        return conn.execute(query).first()

    def _insert_absent(self, conn: sa.Connection, table: sa.Table, values: dict[str, Any]) -> bool:
        """Insert ``values`` unless the primary key exists; whether this call inserted.

        The statement is built once per table and the values bound at execute
        time: building ``insert().values(...)`` per row cost more than the row.
        """
        stmt = self._inserts.get(table.name)
        if stmt is None:
            if self._d.insert is not None:
                # RETURNING, not rowcount: drivers need not count INSERTs.
                stmt = self._d.insert(table).on_conflict_do_nothing().returning(table.c.namespace)
            else:
                stmt = table.insert()
            self._inserts[table.name] = stmt
        if self._d.insert is not None:
            return conn.execute(stmt, values).first() is not None
        try:
            conn.execute(stmt, values)
        except sa_exc.IntegrityError as exc:
            if sql_engine.error_code(exc.orig) == sql_engine.DUPLICATE_KEY:
                return False
            raise
        return True

    def _values(self, job: Job, *, key: bool = True) -> dict[str, Any]:
        retention = self._compaction.retention_of(job.ref, self._retention)
        return sql_rows.job_values(job, self._namespace, retention, key=key)

    _job = staticmethod(sql_rows.job_from_row)
