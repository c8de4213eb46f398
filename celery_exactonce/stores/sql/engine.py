"""The SQL store's dialects and drivers: what differs per database, and the engine it runs on.

:data:`DIALECTS` is the small table of what differs between PostgreSQL,
MySQL/MariaDB and SQLite: the server clock, the insert that skips a duplicate
key, whether rows can be locked, the error codes worth a rerun, and the engine
defaults. :func:`engine_from_url` builds the engine
:meth:`SqlStore.from_url <celery_exactonce.stores.sql.store.SqlStore.from_url>`
uses, with its pool listeners, and :func:`shown_url` the way errors name it
(credentials redacted, a multi-host URL's hosts as written);
:func:`install_sqlite_listeners` makes any SQLite engine begin and journal as
the store needs.

Store time is the database server's clock, read once per statement or
transaction (in SQL, as integer microseconds since the UNIX epoch):

* PostgreSQL: ``clock_timestamp()`` (µs);
* MySQL/MariaDB: ``TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(6))``
  (µs, independent of the session time zone, DST folds included);
* SQLite: ``strftime('%s')`` plus the milliseconds of ``strftime('%f')``
  (SQLite's own clock has millisecond resolution).

PostgreSQL and MySQL run at ``READ COMMITTED``; SQLite runs every write
transaction under ``BEGIN IMMEDIATE`` (which serialises writers across threads
and processes) in WAL mode with a busy timeout.

Pooled connections (of an engine :func:`engine_from_url` builds) are checked
at checkout without a round trip (no ``pool_pre_ping``): a connection the
server closed has input waiting on its socket, and only such a one is pinged,
and replaced if dead, before anything is sent on it. A returned MySQL
connection is rolled back only when a transaction is open.

:func:`execute` runs one statement alone on a DB-API connection (the hot
path's writes), with work of the caller's while it is on the way where the
driver allows (psycopg 3 in autocommit; PyMySQL).

Not here: running a transaction, its retries and the errors it raises
(:mod:`~celery_exactonce.stores.sql.base`), the tables
(:mod:`~celery_exactonce.stores.sql.schema`), the statements
(:mod:`~celery_exactonce.stores.sql.statements`), a statement run with a
kept plan on PostgreSQL (:mod:`~celery_exactonce.stores.sql.pgwire`).
"""

from __future__ import annotations

import dataclasses
import functools
import select
from collections.abc import Callable, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql, sqlite

from celery_exactonce.core import exceptions
from celery_exactonce.stores import redact_message, redact_url
from celery_exactonce.stores.base import Run
from celery_exactonce.stores.sql import pgwire

_SQLITE_BUSY = 30.0
"""Seconds a SQLite transaction waits for the write lock (``from_url`` default)."""
READ = "exactonce_read"
"""Execution option of read-only transactions (SQLite: plain ``BEGIN``)."""


@dataclasses.dataclass(frozen=True)
class Dialect:
    now: str
    """SQL expression of the server clock in integer microseconds since the epoch."""
    insert: Callable[[sa.Table], Any] | None
    """An insert with ``on_conflict_do_nothing``; ``None``: catch the duplicate key."""
    locks: bool
    """``FOR UPDATE [SKIP LOCKED]`` exists (else ``BEGIN IMMEDIATE`` serialises)."""
    retry: frozenset[object]
    """Error codes after which the transaction was rolled back and may be rerun."""
    unavailable: frozenset[object] | None
    """Codes of an ``OperationalError`` worth retrying later; ``None``: every one."""
    engine: Mapping[str, Any]
    """Defaults for :func:`sqlalchemy.create_engine`."""


DIALECTS: dict[str, Dialect] = {
    "postgresql": Dialect(
        now="floor(extract(epoch from clock_timestamp()) * 1000000)::bigint",
        insert=postgresql.insert,
        locks=True,
        retry=frozenset({"40001", "40P01", "55P03"}),
        unavailable=None,
        engine={"isolation_level": "READ COMMITTED", "connect_args": {"connect_timeout": 10}},
    ),
    "mysql": Dialect(
        now="TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))",
        insert=None,
        locks=True,
        retry=frozenset({1205, 1213}),
        unavailable=None,
        engine={"isolation_level": "READ COMMITTED", "connect_args": {"connect_timeout": 10}},
    ),
    "sqlite": Dialect(
        now="CAST(strftime('%s', 'now') AS INTEGER) * 1000000"
        " + CAST(substr(strftime('%f', 'now'), 4, 3) AS INTEGER) * 1000",
        insert=sqlite.insert,
        locks=False,
        retry=frozenset({5, 6}),  # SQLITE_BUSY, SQLITE_LOCKED
        unavailable=frozenset({5, 6, 10, 13, 14}),  # … IOERR, FULL, CANTOPEN
        engine={"connect_args": {"check_same_thread": False, "timeout": _SQLITE_BUSY}},
    ),
}
DUPLICATE_KEY = 1062  # MySQL: does not abort the transaction, only the statement
UNIQUE_VIOLATION = "23505"  # PostgreSQL: aborts the statement (and its transaction)


def error_code(exc: BaseException | None) -> object:
    """The driver's error code: SQLSTATE (psycopg), errno (PyMySQL), primary code (sqlite3)."""
    if exc is None:
        return None
    args = getattr(exc, "args", ())
    if args and isinstance(args[0], int):  # PyMySQL: (errno, message); it has a sqlstate too
        return args[0]
    sqlite_code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(sqlite_code, int):
        return sqlite_code & 0xFF
    return getattr(exc, "sqlstate", None)


def _sqlite_connect(dbapi_conn: Any, _record: Any) -> None:
    # The pysqlite recipe of the SQLAlchemy docs: let SQLAlchemy emit BEGIN.
    dbapi_conn.isolation_level = None
    # The busy timeout is sqlite3's ``timeout`` (from_url: 30 s), so WAL waits for it too.
    cursor = dbapi_conn.cursor()
    try:
        cursor.execute("PRAGMA journal_mode = WAL")
    finally:
        cursor.close()


def _sqlite_begin(conn: sa.Connection) -> None:
    read = conn.get_execution_options().get(READ, False)
    conn.exec_driver_sql("BEGIN" if read else "BEGIN IMMEDIATE")


def install_sqlite_listeners(engine: sa.Engine) -> None:
    """Add the WAL and ``BEGIN [IMMEDIATE]`` listeners to a SQLite engine (once)."""
    for name, listener in (("connect", _sqlite_connect), ("begin", _sqlite_begin)):
        if not event.contains(engine, name, listener):
            event.listen(engine, name, listener)


def _socket(dbapi_conn: Any) -> int | None:
    """The socket of a psycopg 3 or PyMySQL connection (``-1``: closed); ``None``: other drivers."""
    pgconn = getattr(dbapi_conn, "pgconn", None)
    if pgconn is not None:  # psycopg 3
        try:
            return int(pgconn.socket)
        except Exception:  # psycopg raises once the connection is lost
            return -1
    if hasattr(dbapi_conn, "_sock"):  # PyMySQL: None once closed
        sock = dbapi_conn._sock
        return -1 if sock is None else int(sock.fileno())
    return None


def _has_input(fd: int) -> bool:
    """Whether ``fd`` can be read (or is closed or in error) right now, without waiting."""
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLPRI)
        return bool(poller.poll(0))
    return bool(select.select([fd], [], [], 0)[0])  # pragma: no cover - no poll (Windows)


def _check_on_checkout(dialect: sa.Dialect) -> Callable[[Any, Any, Any], None]:
    """A pool ``checkout`` listener that finds a dead pooled connection without a round trip.

    Stands in for ``pool_pre_ping`` (a round trip before every operation). An
    idle connection has nothing to read: a server that closed it (restart,
    ``wait_timeout``, a killed session) left its goodbye or the end of the
    stream on the socket. So only a connection with input is pinged, and one
    that fails is replaced before any statement is sent on it
    (``DisconnectionError``: the pool connects anew). A connection that dies
    after the check fails its statement, whose outcome is then unknown, as the
    store contract says; nothing is sent again.
    """

    def check(dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
        fd = _socket(dbapi_conn)
        if fd is None or (fd >= 0 and not _has_input(fd)):
            return
        try:
            if fd >= 0 and dialect.do_ping(dbapi_conn):  # input on an idle connection: ask
                return
        except Exception as exc:
            raise sa_exc.DisconnectionError(f"dead pooled connection: {exc}") from exc
        raise sa_exc.DisconnectionError("dead pooled connection")

    return check


def _plan_each_call(dbapi_conn: Any, _record: Any) -> None:
    """A ``connect`` listener: PostgreSQL plans each run of a prepared statement anew.

    psycopg 3 prepares a statement run often, and after five runs PostgreSQL
    may keep one generic plan for it. A plan made while the tables were
    nearly empty (a new store; statistics that say so, as after a ``VACUUM``
    of empty tables) reads a whole table for one key, and stays until the
    table is analyzed again: claims slowed from thousands a second to
    hundreds as the tables grew. Planning each run costs far less than that.
    """
    cursor = dbapi_conn.cursor()
    try:
        cursor.execute("SET plan_cache_mode = force_custom_plan")
    finally:
        cursor.close()
    dbapi_conn.commit()
    pgwire.allow(dbapi_conn)  # a statement whose plan reads no table may keep one


def overlaps(driver: Any) -> bool:
    """Whether :func:`execute` can run a function while ``driver``'s statement is on the way:
    psycopg 3 in autocommit, or PyMySQL (:func:`pymysql_splits`); else it runs first."""
    if _pymysql_overlaps(driver):
        return True
    return hasattr(type(driver), "pipeline") and driver.autocommit is True and pgwire.splits()


_READ = "_read_query_result"  # PyMySQL's, called once a query is written


@functools.cache
def pymysql_splits() -> bool:
    """Whether PyMySQL is here and ``Cursor.execute`` reads the answer by the connection's
    ``_read_query_result`` (once the query is written): :func:`execute` wraps it for one call."""
    try:
        from pymysql.connections import Connection  # type: ignore[import-untyped]
    except ImportError:  # pragma: no cover - PyMySQL not installed
        return False
    return callable(getattr(Connection, _READ, None))


def _pymysql_overlaps(driver: Any) -> bool:
    if not pymysql_splits():
        return False
    from pymysql.connections import Connection

    return isinstance(driver, Connection) and _READ not in vars(driver)


def _pymysql_meanwhile(cursor: Any, sql: str, values: Any, meanwhile: Callable[[], None]) -> None:
    """``cursor.execute``, ``meanwhile`` run once the query is sent, before its answer is read.

    What it raises is raised once the answer is read; it does not run if the query cannot be
    sent, and runs first on a connection with an earlier message's answers unread."""
    driver = cursor.connection
    if getattr(getattr(driver, "_result", None), "has_next", False):
        meanwhile()
        cursor.execute(sql, values)
        return
    read, failed = getattr(driver, _READ), []

    def read_after(*args: Any, **kwargs: Any) -> Any:
        vars(driver).pop(_READ, None)  # once: a later answer (the COMMIT's) is read as ever
        try:
            meanwhile()
        except BaseException as exc:  # raised below, once the answer is read
            failed.append(exc)
        return read(*args, **kwargs)

    setattr(driver, _READ, read_after)
    try:
        cursor.execute(sql, values)
    finally:
        vars(driver).pop(_READ, None)
    if failed:
        raise failed[0]


def execute(
    driver: Any,
    sql: str,
    values: Any,
    meanwhile: Run,
    *,
    drain: bool = False,
    keep: pgwire.Settings | None = None,
) -> Any:
    """Run one statement on a DB-API connection: its rows (``None``: it answers none).

    ``keep``: the statement's generic plan is its custom one (an ``INSERT``
    of bound values, :data:`~.pgwire.AS_IS`; a one-row ``UPDATE`` by its key,
    :data:`~.pgwire.BY_KEY`, under those settings): on the store's PostgreSQL
    connections it runs with a kept plan
    (:mod:`~celery_exactonce.stores.sql.pgwire`), ``meanwhile`` while it is on the way.

    ``drain``: ``sql`` is more than one statement (:data:`COMMITS`): the
    answers after the first are read (and their errors raised).

    ``meanwhile`` runs while the statement's answer is on the way where the
    driver can (:func:`overlaps`: an autocommit statement's commit, or the
    ``COMMIT`` sent with it, too, runs on the server meanwhile): one message to the server, as
    ``Cursor.execute`` sends it, and the answer read after ``meanwhile``.
    Elsewhere it runs before the statement is sent. It must not raise.
    """
    if keep is not None and pgwire.keeps(driver):
        try:
            form = pgwire.kept(sql, keep)
            params = pgwire.values_of(driver, form, values)
        except TypeError:  # a value with no text form here: psycopg's way
            pass
        else:
            return pgwire.run_kept(driver, form, params, meanwhile)
    cursor = driver.cursor()
    try:
        if meanwhile is not None and _pymysql_overlaps(driver):
            _pymysql_meanwhile(cursor, sql, values, meanwhile)
        elif meanwhile is not None and overlaps(driver):
            with driver.lock:
                driver.wait(pgwire.at_first_read(cursor._execute_gen(sql, values), meanwhile))
        else:
            if meanwhile is not None:
                meanwhile()
            cursor.execute(sql, values)
        rows = cursor.fetchall() if cursor.description is not None else None
        while drain and cursor.nextset():
            pass
        return rows
    finally:
        cursor.close()


_MULTI_STATEMENTS = 1 << 16  # pymysql.constants.CLIENT.MULTI_STATEMENTS (the protocol's)
COMMITS = "; COMMIT"
"""What ends a MySQL statement run alone when its connection takes several statements
a message (:func:`commits_in_statement`): its commit, in the same round trip."""


def commits_in_statement(driver: Any) -> bool:
    """Whether a statement sent on ``driver`` may carry its ``COMMIT`` (:data:`COMMITS`):
    a PyMySQL connection with ``CLIENT.MULTI_STATEMENTS`` (:func:`engine_from_url`'s)."""
    return bool(getattr(driver, "client_flag", 0) & _MULTI_STATEMENTS)


def _multi_statements(_dialect: Any, _record: Any, _cargs: Any, cparams: dict[str, Any]) -> None:
    """A ``do_connect`` listener: PyMySQL connections take several statements a message,
    so a one-statement write and its ``COMMIT`` are one round trip. Every value is
    still bound by the driver, escaped; the flags SQLAlchemy asks (``FOUND_ROWS``) stay."""
    cparams["client_flag"] = int(cparams.get("client_flag", 0)) | _MULTI_STATEMENTS


_MYSQL_IN_TRANS = 1  # SERVER_STATUS_IN_TRANS, from the status of the server's last reply


def _reset_mysql(dbapi_conn: Any, _record: Any, state: Any) -> None:
    """The pool's reset of a returned MySQL connection: roll back only an open transaction.

    SQLAlchemy's default reset sends ``ROLLBACK`` on every return, a round
    trip per operation: the store ends each transaction itself (committed, or
    rolled back on error), and PyMySQL knows from the server's last reply
    whether one is still open.
    """
    if getattr(state, "terminate_only", False):
        return
    status = getattr(dbapi_conn, "server_status", None)
    if not isinstance(status, int) or status & _MYSQL_IN_TRANS:
        dbapi_conn.rollback()


def shown_url(url: sa.URL) -> str:
    """``url`` as errors and logs show it: credentials redacted, its hosts as written.

    SQLAlchemy renders query values percent-encoded; a libpq multi-host URL
    (``?host=db1:5432&host=db2:5432``) reads better with its ``:`` and ``,``
    as the user wrote them, and neither is a credential.
    """
    text = redact_url(url.render_as_string(hide_password=False))
    head, mark, query = text.partition("?")
    return head + mark + query.replace("%3A", ":").replace("%2C", ",")


def engine_from_url(url: str, engine_kwargs: dict[str, Any]) -> sa.Engine:
    """The engine of :meth:`~celery_exactonce.stores.sql.store.SqlStore.from_url`.

    ``engine_kwargs`` go to :func:`sqlalchemy.create_engine` over the
    dialect's defaults. Raises ``ConfigurationError`` (the URL redacted) for a
    URL that names no supported dialect or that the driver refuses.
    """
    shown = redact_url(url)
    try:
        sa_url = sa.engine.make_url(url)
        dialect = DIALECTS.get(sa_url.get_backend_name())
        if dialect is None:
            raise exceptions.ConfigurationError(
                f"exactonce_store_url={shown!r}: not a PostgreSQL, MySQL or SQLite URL",
                setting="exactonce_store_url",
            )
        kwargs: dict[str, Any] = dict(dialect.engine)
        connect_args = {
            **kwargs.get("connect_args", {}),
            **engine_kwargs.pop("connect_args", {}),
        }
        kwargs.update(engine_kwargs, connect_args=connect_args)
        own_reset = sa_url.get_backend_name() == "mysql" and "pool_reset_on_return" not in kwargs
        if own_reset:
            kwargs["pool_reset_on_return"] = None
        engine = sa.create_engine(sa_url, **kwargs)
        if own_reset:
            event.listen(engine, "reset", _reset_mysql)
        if engine.dialect.name == "mysql" and engine.dialect.driver == "pymysql":
            event.listen(engine, "do_connect", _multi_statements)
        if engine.dialect.name in ("postgresql", "mysql"):
            event.listen(engine, "checkout", _check_on_checkout(engine.dialect))
        if engine.dialect.name == "postgresql":
            event.listen(engine, "connect", _plan_each_call)
    except (sa_exc.ArgumentError, ImportError, TypeError, ValueError) as exc:
        detail = redact_message(str(exc), url)
        raise exceptions.ConfigurationError(
            f"exactonce_store_url={shown!r}: {type(exc).__name__}: {detail}",
            setting="exactonce_store_url",
        ) from None
    return engine
