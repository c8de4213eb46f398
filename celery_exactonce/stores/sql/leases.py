"""The SQL store's leases: a named lease held by one token until it expires.

:class:`SqlLeases` is the part of :class:`~celery_exactonce.stores.sql.store.SqlStore`
that acquires, renews, releases and reads a lease inside its transaction, and that
tells whether a lease is held at a given store time. Acquiring locks the
lease's row (inserting it when absent; a competing insert reruns the
transaction); renewing and releasing change the row only while the token
holds it unexpired. A transition that carries a lease checks it with
:meth:`SqlLeases._holds`, which locks the row shared: the lease cannot change
hands before that transaction ends (SQLite has no row locks:
``BEGIN IMMEDIATE`` serialises its writers).

Not here: the transitions that check a lease
(:mod:`~celery_exactonce.stores.sql.transitions`), the transaction each
operation runs in (:mod:`~celery_exactonce.stores.sql.store`).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

import sqlalchemy as sa

from celery_exactonce.core import times
from celery_exactonce.core.writes import Lease
from celery_exactonce.stores.sql.base import Rerun
from celery_exactonce.stores.sql.shared import SqlShared


class SqlLeases(SqlShared):
    """Leases, inside their transaction."""

    def _acquire_lease_op(
        self, name: str, token: str, ttl: float
    ) -> Callable[[sa.Connection], bool]:
        """The transaction of ``acquire_lease`` (the name and token checked first)."""
        Lease(name, token)  # validates
        leases = self._t.leases
        where = (leases.c.namespace == self._namespace, leases.c.name == name)

        def op(conn: sa.Connection) -> bool:
            now = self._now(conn)
            until = now + round(ttl * 1_000_000)
            row = self._locked(conn, leases, where)
            if row is None:
                values = {"namespace": self._namespace, "name": name, "token": token}
                if self._insert_absent(conn, leases, {**values, "expires_at": until}):
                    return True
                raise Rerun  # another node inserted it first: decide on its row
            if row.token != token and row.expires_at > now:
                return False
            conn.execute(leases.update().where(*where).values(token=token, expires_at=until))
            return True

        return op

    def _renew_lease_op(self, name: str, token: str, ttl: float) -> Callable[[sa.Connection], bool]:
        """The transaction of ``renew_lease``: the expiry moved while the lease is held."""
        leases = self._t.leases

        def op(conn: sa.Connection) -> bool:
            now = self._now(conn)
            result = conn.execute(
                leases.update()
                .where(*self._lease_held(name, token, now))
                .values(expires_at=now + round(ttl * 1_000_000))
            )
            return bool(result.rowcount == 1)

        return op

    def _release_lease_op(self, name: str, token: str) -> Callable[[sa.Connection], bool]:
        """The transaction of ``release_lease``: the row deleted while the lease is held."""
        leases = self._t.leases

        def op(conn: sa.Connection) -> bool:
            now = self._now(conn)
            result = conn.execute(leases.delete().where(*self._lease_held(name, token, now)))
            return bool(result.rowcount == 1)

        return op

    def _lease_op(self, name: str) -> Callable[[sa.Connection], tuple[str, datetime] | None]:
        """The transaction of ``lease``: the unexpired row's token and expiry."""
        c = self._t.leases.c

        def op(conn: sa.Connection) -> tuple[str, datetime] | None:
            now = self._now(conn)
            query = sa.select(c.token, c.expires_at).where(
                c.namespace == self._namespace, c.name == name, c.expires_at > now
            )
            row = conn.execute(query).first()
            return None if row is None else (str(row.token), times.from_micros(row.expires_at))

        return op

    def _holds(self, conn: sa.Connection, name: str, token: str, now: int) -> bool:
        # A shared lock: the lease cannot change hands before this transaction ends.
        query = sa.select(self._t.leases.c.token).where(*self._lease_held(name, token, now))
        if self._d.locks:
            query = query.with_for_update(read=True)
        return conn.execute(query).first() is not None

    def _lease_held(self, name: str, token: str, now: int) -> tuple[sa.ColumnElement[bool], ...]:
        c = self._t.leases.c
        return (
            c.namespace == self._namespace,
            c.name == name,
            c.token == token,
            c.expires_at > now,
        )
