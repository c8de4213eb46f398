"""SqlStore: the job store in PostgreSQL, MySQL/MariaDB or SQLite (SQLAlchemy Core).

One class serves the three dialects; what differs between them is the small
:data:`~celery_exactonce.stores.sql_engine.DIALECTS` table. Each operation is
one database transaction (retried as a whole, bounded and with jittered
backoff, after a deadlock, a serialization failure, a lock-wait timeout or
SQLite's "database is locked": such a transaction was rolled back, so running
it again is safe). The guards and effects of a transition are those of
:mod:`celery_exactonce.jobs`.

The hot writes are one statement each (:mod:`~celery_exactonce.stores.sql_statements`):
a transition is an ``UPDATE`` whose ``WHERE`` holds every guard and whose
``SET`` restates :func:`~celery_exactonce.jobs.apply_transition`; a create is
an ``INSERT … SELECT`` checking the epoch (and, on PostgreSQL, advancing an
occurrence's watermark in the same statement); a heartbeat is one ``UPDATE``.
On PostgreSQL such a statement runs on its own (autocommit: one round trip);
MySQL and SQLite commit it. What one statement cannot decide (a conflict, a
lost lease, a record a competing create committed after the statement began,
an occurrence on MySQL/SQLite, a create on SQLite or on a MySQL without
``INSERT … RETURNING``, a transition that rewrites the payload) goes the
locking way: read the record under a lock, ask
:func:`~celery_exactonce.jobs.check_transition`, write what
:func:`~celery_exactonce.jobs.apply_transition` returns. A statement that
changed nothing is decided again so; one that changed something is never sent
again.

Store time is the database server's clock, read once per statement or
transaction (how, per dialect: :mod:`~celery_exactonce.stores.sql_engine`).

Locking: PostgreSQL and MySQL run at ``READ COMMITTED`` and lock the rows a
decision depends on (an ``UPDATE`` locks its row; ``SELECT … FOR UPDATE``
on the locking way, ``SKIP LOCKED`` for claims and purges; a lease a
transition checks is locked shared); SQLite runs every write transaction under
``BEGIN IMMEDIATE`` (which serialises writers across threads and processes) in
WAL mode with a busy timeout.

The dialects, the engine :meth:`SqlStore.from_url` builds and its pool
checks are in :mod:`~celery_exactonce.stores.sql_engine`.

What every operation stands on (the store's state, running a transaction
with its retries and errors, fork safety, the row helpers) is
:class:`~celery_exactonce.stores.sql_core.SqlCore`, the base of the store.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from celery_exactonce import jobs
from celery_exactonce.jobs import (
    CreateResult,
    Job,
    JobRef,
    NewJob,
    Transition,
    TransitionResult,
)
from celery_exactonce.states import State
from celery_exactonce.stores import sql_engine, sql_schema
from celery_exactonce.stores.sql_core import Slow
from celery_exactonce.stores.sql_creates import SqlCreates
from celery_exactonce.stores.sql_transitions import SqlTransitions

__all__ = ["SqlStore"]

#: Identifiers per ``IN (...)`` list: below every dialect's bound-parameter limit.
_IN_CHUNK = 500


class SqlStore(SqlCreates, SqlTransitions):
    """A :class:`~celery_exactonce.stores.base.StateStore` in a SQL database.

    Parameters
    ----------
    engine
        A SQLAlchemy engine (PostgreSQL with psycopg, MySQL/MariaDB with
        PyMySQL, or SQLite). On SQLite the store adds the ``BEGIN IMMEDIATE``
        and WAL listeners to it; build it with :meth:`from_url` to get the
        right pool and driver settings.
    namespace
        Every row this store touches carries it (1-64 characters).
    retention
        Seconds a terminal record is kept, counted from ``max(fire_time, terminal_at)``.
    table_prefix
        Prefix of the five tables (``{prefix}jobs``, ``watermarks``, ``leases``,
        ``meta``, ``schema``): 1-32 letters, digits or ``_``.
    """

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        namespace: str,
        retention: float,
        table_prefix: str = "exactonce_",
        **engine_kwargs: Any,
    ) -> SqlStore:
        """Build the engine for ``url`` (a SQLAlchemy URL naming its driver) and the store.

        ``engine_kwargs`` go to :func:`sqlalchemy.create_engine` over the
        defaults of the dialect (``READ COMMITTED``, connect timeouts; SQLite:
        ``check_same_thread=False`` and a 30 s busy timeout). Instead of
        ``pool_pre_ping`` (a round trip per operation), a pooled PostgreSQL or
        MySQL connection is checked at checkout without one (its socket must
        have nothing to read) and pinged only when that check fails; passing
        ``pool_pre_ping=True`` pings every checkout as well. A MySQL connection
        returned to the pool is rolled back only when a transaction is open
        (not on every return).
        """
        engine = sql_engine.engine_from_url(url, engine_kwargs)
        store = cls(engine, namespace=namespace, retention=retention, table_prefix=table_prefix)
        store._owns_engine = True
        return store

    def __repr__(self) -> str:
        return f"SqlStore({self._where}, namespace={self._namespace!r})"

    # -- properties and housekeeping -------------------------------------------------

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def retention(self) -> float:
        return self._retention

    @property
    def engine(self) -> sa.Engine:
        return self._engine

    def now(self) -> datetime:
        return jobs.from_micros(self._run("now", self._now, write=False))

    def setup(self) -> None:
        """Create absent tables and indexes, record or upgrade the schema version. Idempotent.

        Raises
        ------
        SchemaMismatch
            The database holds a newer schema version than this code writes.
        """
        # Set-up is idempotent, so a transient failure (SQLite's "database is
        # locked" while another process switches the journal to WAL, a deadlock
        # between concurrent CREATEs) is simply retried.
        self._run_idempotent("setup", lambda: sql_schema.create(self._engine, self._t, self._where))

    def ping(self) -> None:
        """Run ``SELECT 1``; raise ``StoreUnavailable`` when the database does not answer."""
        self._run("ping", lambda conn: conn.execute(sa.select(1)).scalar_one(), write=False)

    def drop_namespace(self) -> None:
        """Delete every row of this namespace (jobs, watermarks, leases, epoch)."""

        def op(conn: sa.Connection) -> None:
            for table in self._t.per_namespace:
                conn.execute(table.delete().where(table.c.namespace == self._namespace))

        self._run("drop_namespace", op)

    def close(self) -> None:
        """Mark the store closed; dispose the engine's pool if :meth:`from_url` built it."""
        self._mark_closed()
        if self._owns_engine:
            self._engine.dispose()

    # -- epoch and create ------------------------------------------------------------

    def epoch(self, *, replace: str | None = None) -> str:
        return self._run("epoch", self._epoch_op(replace))

    def create(self, new: NewJob, *, epoch: str | None = None) -> CreateResult:
        if self._autocommit and self._fast_create(new):
            try:
                result = self._run(
                    "create",
                    lambda conn: self._create_fast(conn, new, epoch, brief=False),
                    autocommit=True,
                )
            except Slow:
                result = None  # the statement failed whole: nothing was written
            if result is not None:
                return result
            return self._run("create", lambda conn: self._create(conn, new, epoch))
        return self._run("create", lambda conn: self._create_one(conn, new, epoch))

    def create_many(
        self, news: Sequence[NewJob], *, epoch: str | None = None, brief: bool = False
    ) -> list[CreateResult]:
        """One transaction for the batch, watermarks locked in entry order (no deadlocks).

        Creates of one entry keep their fire-time order, so the watermark
        semantics are those of calling :meth:`create` in turn.
        """
        if not news:
            self._check_usable()
            return []
        return self._run("create_many", self._create_many_op(news, epoch, brief))

    def get(self, ref: JobRef) -> Job | None:
        return self._run("get", lambda conn: self._select_job(conn, ref), write=False)

    # -- transitions -----------------------------------------------------------------

    def transition(self, ref: JobRef, request: Transition) -> TransitionResult:
        if self._autocommit and self._fast_transition(request):
            result = self._run(
                "transition",
                lambda conn: self._transition_fast(conn, ref, request, brief=False),
                autocommit=True,
            )
            if result is not None:
                return result
        return self._run(
            "transition", lambda conn: self._transition_one(conn, ref, request, brief=False)
        )

    def transition_many(
        self, requests: Sequence[tuple[JobRef, Transition]], *, brief: bool = False
    ) -> list[TransitionResult]:
        """One transaction for the batch; rows locked in key order (no deadlock)."""
        if not requests:
            self._check_usable()
            return []
        return self._run("transition_many", self._transition_many_op(requests, brief))

    def heartbeat(self, ref: JobRef, run_id: str) -> bool:
        stmt, params = self._sql.heartbeat(self._namespace, ref, run_id)
        return self._run(
            "heartbeat",
            lambda conn: bool(conn.execute(stmt, params).rowcount == 1),
            autocommit=self._autocommit,
        )

    def annotate(self, ref: JobRef, *, node: str, reason: str, op_id: str) -> bool:
        return self._run("annotate", self._annotate_op(ref, node, reason, op_id))

    def watermark(self, entry: str) -> datetime | None:
        return self.watermarks([entry]).get(entry)

    def watermarks(self, entries: Sequence[str]) -> dict[str, datetime]:
        if not entries:
            self._check_usable()
            return {}
        wm = self._t.watermarks
        wanted = list(dict.fromkeys(entries))

        def op(conn: sa.Connection) -> dict[str, datetime]:
            found: dict[str, datetime] = {}
            for i in range(0, len(wanted), _IN_CHUNK):
                query = sa.select(wm.c.entry, wm.c.fire_time).where(
                    wm.c.namespace == self._namespace,
                    wm.c.entry.in_(wanted[i : i + _IN_CHUNK]),
                    wm.c.fire_time.is_not(None),
                )
                found.update(
                    (row.entry, jobs.from_micros(row.fire_time)) for row in conn.execute(query)
                )
            return found

        return self._run("watermarks", op, write=False)

    def list_stale(
        self,
        state: State,
        older_than: float,
        limit: int,
        *,
        after: tuple[datetime, JobRef] | None = None,
    ) -> list[Job]:
        state = State(state)
        c = self._t.jobs.c
        # (space, id) orders as str(ref) does: the space is one character, then ':'.
        past: list[sa.ColumnElement[bool]] = []
        if after is not None:
            # (touched_at, space, id) > the cursor, spelt so that the index on
            # (namespace, state, touched_at) bounds the scan: touched_at >= t.
            t, ref = jobs.to_micros(after[0]), after[1]
            past = [
                c.touched_at >= t,
                sa.or_(
                    c.touched_at > t,
                    c.space > ref.space.value,
                    sa.and_(c.space == ref.space.value, c.id > ref.id),
                ),
            ]

        def op(conn: sa.Connection) -> list[Job]:
            cutoff = self._now(conn) - round(older_than * 1_000_000)
            rows = conn.execute(
                sa.select(self._t.jobs)
                .where(
                    c.namespace == self._namespace, c.state == state.value, c.touched_at <= cutoff,
                    *past,
                )
                .order_by(c.touched_at, c.space, c.id)
                .limit(limit)
            )  # fmt: skip
            return [self._job(row) for row in rows]

        return self._run("list_stale", op, write=False) if limit > 0 else self._empty([])

    def claim_due(self, limit: int, *, node: str, reason: str = "claimed") -> list[Job]:
        def claim() -> Transition:
            return Transition(State.SCHEDULED, frozenset({State.PENDING}), node=node, reason=reason)

        claim()  # validates node and reason before anything is read
        table, c = self._t.jobs, self._t.jobs.c

        def op(conn: sa.Connection) -> list[Job]:
            now = self._now(conn)
            query = (
                sa.select(table)
                .where(
                    c.namespace == self._namespace, c.state == State.PENDING.value, c.run_at <= now
                )
                .order_by(c.run_at, c.space, c.id)
                .limit(limit)
            )
            if self._d.locks:
                query = query.with_for_update(skip_locked=True)
            due = [self._job(row) for row in conn.execute(query)]
            claimed = [jobs.apply_transition(job, claim(), jobs.from_micros(now)) for job in due]
            if claimed:
                update = table.update().where(
                    c.namespace == self._namespace,
                    c.space == sa.bindparam("k_space"),
                    c.id == sa.bindparam("k_id"),
                    c.rev == sa.bindparam("k_rev"),
                )
                params = [
                    {
                        **self._values(new, key=False),
                        "k_space": old.ref.space.value,
                        "k_id": old.ref.id,
                        "k_rev": old.rev,
                    }
                    for old, new in zip(due, claimed, strict=True)
                ]
                conn.execute(update, params)
            return claimed

        return self._run("claim_due", op) if limit > 0 else self._empty([])

    def purge_expired(self, limit: int) -> int:
        table, c = self._t.jobs, self._t.jobs.c

        def op(conn: sa.Connection) -> int:
            now = self._now(conn)
            expired = (c.namespace == self._namespace, c.expires_at <= now)
            query = sa.select(c.space, c.id).where(*expired).order_by(c.expires_at).limit(limit)
            if self._d.locks:
                query = query.with_for_update(skip_locked=True)
            keys = [(row.space, row.id) for row in conn.execute(query)]
            if not keys:
                return 0
            result = conn.execute(
                table.delete().where(*expired, sa.tuple_(c.space, c.id).in_(keys))
            )
            return int(result.rowcount)

        return self._run("purge_expired", op) if limit > 0 else self._empty(0)

    # -- leases ------------------------------------------------------------------------

    def acquire_lease(self, name: str, token: str, ttl: float) -> bool:
        return self._run("acquire_lease", self._acquire_lease_op(name, token, ttl))

    def renew_lease(self, name: str, token: str, ttl: float) -> bool:
        return self._run("renew_lease", self._renew_lease_op(name, token, ttl))

    def release_lease(self, name: str, token: str) -> bool:
        return self._run("release_lease", self._release_lease_op(name, token))
