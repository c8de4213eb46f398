"""The SQL store's named rows: leases held by one token until they expire, stored entries.

:class:`SqlLeases` is the part of :class:`~celery_exactonce.stores.sql.store.SqlStore`
that acquires, renews, releases and reads a lease inside its transaction, and that
tells whether a lease is held at a given store time. Acquiring locks the
lease's row (inserting it when absent; a competing insert reruns the
transaction); renewing and releasing change the row only while the token
holds it unexpired. A transition that carries a lease checks it with
:meth:`SqlLeases._holds`, which locks the row shared: the lease cannot change
hands before that transaction ends (SQLite has no row locks:
``BEGIN IMMEDIATE`` serialises its writers).

Stored beat entries (:class:`SqlEntries`) are a row each in the entries
table, and a row under the empty name holds their revision: a write locks
that row first (inserting it when absent; a competing insert reruns the
transaction), compares the entry with what the writer expects, then writes
it and moves the revision, so writes are serialised and each gets its own
revision.

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
from celery_exactonce.stores.base import Unchecked, check_entry_name, matches
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


#: The name of the entries table's row that holds their revision (no entry is named so).
REVISION_ROW = ""


class SqlEntries(SqlShared):
    """Stored beat entries, inside their transaction."""

    def _entries_revision_op(self) -> Callable[[sa.Connection], int]:
        """The transaction of ``entries_revision``: the revision row's, 0 without one."""
        c = self._t.entries.c
        query = sa.select(c.revision).where(c.namespace == self._namespace, c.name == REVISION_ROW)

        def op(conn: sa.Connection) -> int:
            found = conn.execute(query).scalar()
            return 0 if found is None else int(found)

        return op

    def _read_entries_op(self) -> Callable[[sa.Connection], tuple[int, dict[str, str]]]:
        """The transaction of ``read_entries``: every row of the namespace, in one statement."""
        c = self._t.entries.c
        query = sa.select(c.name, c.definition, c.revision).where(c.namespace == self._namespace)

        def op(conn: sa.Connection) -> tuple[int, dict[str, str]]:
            revision, definitions = 0, {}
            for row in conn.execute(query):
                if row.name == REVISION_ROW:
                    revision = int(row.revision)
                else:
                    definitions[str(row.name)] = str(row.definition)
            return revision, definitions

        return op

    def _write_entry_op(
        self, name: str, definition: str | None, expect: str | Unchecked | None
    ) -> Callable[[sa.Connection], int | None]:
        """The transaction of ``write_entry``: the revision row locked first (made when
        absent), the entry compared with ``expect``, then written and the revision moved."""
        check_entry_name(name)
        table = self._t.entries
        mine = (table.c.namespace == self._namespace, table.c.name == name)
        marker = (table.c.namespace == self._namespace, table.c.name == REVISION_ROW)

        def op(conn: sa.Connection) -> int | None:
            now = self._now(conn)
            held = self._locked(conn, table, marker)
            if held is None:
                first = {"namespace": self._namespace, "name": REVISION_ROW, "definition": ""}
                if not self._insert_absent(conn, table, first | {"revision": 0, "changed_at": now}):
                    raise Rerun  # another writer made the row first: lock it instead
                held = self._locked(conn, table, marker)
            current = conn.execute(sa.select(table.c.definition).where(*mine)).scalar()
            if held is None or not matches(current, expect):
                return None
            revision = int(held.revision) + 1
            conn.execute(table.update().where(*marker).values(revision=revision, changed_at=now))
            conn.execute(table.delete().where(*mine))
            if definition is not None:
                row = {"namespace": self._namespace, "name": name, "definition": definition}
                conn.execute(table.insert().values(**row, revision=revision, changed_at=now))
            return revision

        return op
