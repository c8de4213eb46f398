"""A transaction a caller holds open across operations of the SQL store, and its own queries.

:meth:`SqlShared.transaction` opens a transaction on a connection of the
store's engine and hands that connection (SQLAlchemy's) to the caller: until
the block ends, every operation of the store made on this thread runs in it
(a one-statement write on its driver connection, as one that commits alone
runs on a pooled one), with no savepoint of its own: an operation that fails
fails the transaction, which the caller then rolls back whole. The block
commits on its way out; an exception rolls everything back, the store's
writes and the caller's together.
:meth:`SqlShared.after_commit` runs a function once that commit is made
(a child job's publish), never after a rollback.

It is what the atomic gate (:mod:`~celery_exactonce.task.atomic`) runs a
body in, on a ``postgresql://``, ``mysql://`` or ``sqlite://`` store whose
database the body writes to through ``self.request.exactonce.connection``.
The Django store has its own, on Django's connection
(:class:`~celery_exactonce.contrib.django.store.DjangoStore`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from celery_exactonce.core import exceptions
from celery_exactonce.observe import metrics
from celery_exactonce.stores.sql.base import SqlCore

_T = TypeVar("_T")


class _Open:
    """The transaction open on this thread: its connection, and what runs once it commits."""

    def __init__(self, conn: sa.Connection) -> None:
        self.conn = conn
        self.after: list[Callable[[], None]] = []


def driver_error(engine: sa.Engine, exc: BaseException) -> BaseException:
    """``exc``, a driver's error on a connection the store did not take from its pool, as
    SQLAlchemy raises it (to raise ``from exc``): the connection is not the store's to drop."""
    error = engine.dialect.loaded_dbapi.Error
    return sa_exc.DBAPIError.instance(None, None, exc, error, connection_invalidated=False)


class SqlShared(SqlCore):
    """The SQL store's :meth:`transaction` and :meth:`after_commit` (see the module docs),
    and whether a one-statement write commits alone (:meth:`_commits_alone`) or runs on
    a driver at all (:meth:`_on_driver`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._shared = threading.local()

    def _open(self) -> _Open | None:
        open_: _Open | None = getattr(self._shared, "open", None)
        return open_

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sa.Connection]:
        """One transaction on a connection of the store's engine, for this thread's
        operations of the store and the caller's own queries on the connection it yields.

        Committed when the block ends (``StoreError``, or ``StoreUnavailable``, if
        the commit fails: whether it was made is then unknown); rolled back if it
        raises. Not nested: a second one on the same thread is refused.
        """
        if self._open() is not None:
            raise exceptions.StoreError(f"{self._where}: a transaction is open on this thread")
        with self._guard("transaction"):
            self._check_usable()
            conn = self._engine.connect()
        try:
            with self._guard("transaction"):
                begun = conn.begin()
            open_ = self._shared.open = _Open(conn)
            try:
                yield conn
            except BaseException:
                with contextlib.suppress(Exception):  # a broken connection: the server rolls back
                    begun.rollback()
                raise
            with self._guard("commit"):
                begun.commit()
        finally:
            self._shared.open = None
            conn.close()
        for fn in open_.after:
            try:
                fn()
            except Exception as exc:  # as Django's robust on_commit: the commit stands
                metrics.event(
                    "after_commit_failed",
                    f"{self._where}: a function run after a commit failed: {exc}",
                    level=logging.ERROR,
                    sentry=True,
                    exc_info=exc,
                )

    def after_commit(self) -> Callable[[Callable[[], None]], None] | None:
        """Inside :meth:`transaction` on this thread: how to run a function once it commits.

        ``None`` outside one (an operation commits at once).
        """
        open_ = self._open()
        return None if open_ is None else open_.after.append

    def _attempt(self, fn: Callable[[sa.Connection], _T], *, write: bool, autocommit: bool) -> _T:
        """Inside :meth:`transaction`: ``fn`` in it; else in a transaction of its own."""
        open_ = self._open()
        if open_ is None:
            return super()._attempt(fn, write=write, autocommit=autocommit)
        return fn(open_.conn)

    def _commits_alone(self) -> bool:
        """Whether a statement run by :meth:`_run_statement` commits at once: not inside
        :meth:`transaction`."""
        return self._open() is None

    def _on_driver(self) -> bool:
        """Whether a one-statement write may run by :meth:`_run_statement`: one that
        commits alone, or one in :meth:`transaction` (it commits with it)."""
        return True

    @contextlib.contextmanager
    def _statement_connection(self) -> Iterator[tuple[Any, bool]]:
        """Inside :meth:`transaction`: its driver connection, nothing to commit; else a
        pooled one (:meth:`SqlCore._statement_connection`)."""
        open_ = self._open()
        if open_ is None:
            with super()._statement_connection() as pooled:
                yield pooled
            return
        try:
            yield open_.conn.connection.driver_connection, False
        except self._driver_errors as exc:
            raise driver_error(self._engine, exc) from exc
