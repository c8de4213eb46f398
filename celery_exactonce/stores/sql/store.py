"""SqlStore: the job store in PostgreSQL, MySQL/MariaDB or SQLite (SQLAlchemy Core).

One class serves the three dialects. Every operation of the
:class:`~celery_exactonce.stores.base.StateStore` contract is defined here, on
:class:`SqlStore` itself, and chooses the transaction it runs in: each
operation is one database transaction, retried as a whole after a rolled-back
conflict; on PostgreSQL a one-statement write runs on its own (autocommit: one
round trip), while MySQL and SQLite commit it. The guards and effects of a
transition are those of :mod:`celery_exactonce.core.jobs`.

The hot writes are one statement each (:mod:`~celery_exactonce.stores.sql.statements`):
a transition is an ``UPDATE`` whose ``WHERE`` holds every guard and whose
``SET`` restates :func:`~celery_exactonce.core.jobs.apply_transition`; a create is
an ``INSERT … SELECT`` checking the epoch (and, on PostgreSQL, advancing an
occurrence's watermark in the same statement); a heartbeat is one ``UPDATE``.
What one statement cannot decide (a conflict, a lost lease, a record a
competing create committed after the statement began, an occurrence on
MySQL/SQLite, a create on SQLite or on a MySQL without ``INSERT … RETURNING``,
a transition that rewrites the payload) goes the locking way: read the record
under a lock, ask :func:`~celery_exactonce.core.jobs.check_transition`, write what
:func:`~celery_exactonce.core.jobs.apply_transition` returns. A statement that
changed nothing is decided again so; one that changed something is never sent
again.

Locking: PostgreSQL and MySQL run at ``READ COMMITTED`` and lock the rows a
decision depends on (an ``UPDATE`` locks its row; ``SELECT … FOR UPDATE``
on the locking way, ``SKIP LOCKED`` for claims and purges; a lease a
transition checks is locked shared); SQLite runs every write transaction under
``BEGIN IMMEDIATE`` (which serialises writers across threads and processes) in
WAL mode with a busy timeout. Store time is the database server's clock, read
once per statement or transaction.

What happens inside a transaction lives in the classes :class:`SqlStore` is
made of, one module each:

* :mod:`~celery_exactonce.stores.sql.base`: the store's state, running a
  transaction (retries, errors, fork safety), the row helpers;
* :mod:`~celery_exactonce.stores.sql.creates`: creates and the namespace epoch;
* :mod:`~celery_exactonce.stores.sql.transitions`: transitions and notes;
* :mod:`~celery_exactonce.stores.sql.leases`: leases;
* :mod:`~celery_exactonce.stores.sql.scans`: watermarks, stale jobs, claims of
  due jobs, purges of expired ones, counts for gauges;
* :mod:`~celery_exactonce.stores.sql.shared`: a transaction the caller holds
  open across operations, and its own queries (the atomic gate).

Beside them: :mod:`~celery_exactonce.stores.sql.engine` (what differs per
dialect, the engine :meth:`SqlStore.from_url` builds, its pool checks),
:mod:`~celery_exactonce.stores.sql.schema` (the tables) and
:mod:`~celery_exactonce.stores.sql.statements` (the one-statement writes, on
:mod:`~celery_exactonce.stores.sql.statements_base`).

Not here: anything done inside a transaction. The operations themselves stay
here, not in those classes, so that whatever wraps a store class's operations
(the acceptance tests' fault injection) finds each one in ``SqlStore.__dict__``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa

from celery_exactonce.core import jobs, times
from celery_exactonce.core.jobs import (
    CreateResult,
    CreateStatus,
    Job,
    TransitionResult,
)
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.skipped_slots import SkippedSlots
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.stores.base import UNCHECKED, DueBacklog, Run, Unchecked
from celery_exactonce.stores.sql import engine as sql_engine
from celery_exactonce.stores.sql import pgwire
from celery_exactonce.stores.sql import schema as sql_schema
from celery_exactonce.stores.sql.base import Slow
from celery_exactonce.stores.sql.creates import SqlCreates
from celery_exactonce.stores.sql.leases import SqlEntries, SqlLeases
from celery_exactonce.stores.sql.scans import SqlScans
from celery_exactonce.stores.sql.transitions import SqlTransitions

__all__ = ["SqlStore"]


class SqlStore(SqlCreates, SqlTransitions, SqlScans, SqlLeases, SqlEntries):
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
        compaction: jobs.Compaction = jobs.KEEP,
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
        (not on every return). A PostgreSQL connection plans each statement
        anew (``plan_cache_mode = force_custom_plan``): a generic plan kept
        from when the tables were empty would read a whole table per key.
        """
        engine = sql_engine.engine_from_url(url, engine_kwargs)
        store = cls(
            engine,
            namespace=namespace,
            retention=retention,
            table_prefix=table_prefix,
            compaction=compaction,
        )
        store._owns_engine = True
        return store

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._where}, namespace={self._namespace!r})"

    # -- properties and housekeeping ---------------------------------------------------

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
        return times.from_micros(self._run("now", self._now, write=False))

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

    #: The schema version this code writes (``stores.base.format_written``).
    format_written = sql_schema.SCHEMA_VERSION

    def schema_version(self) -> int | None:
        def op(conn: sa.Connection) -> int | None:
            return sql_schema.stored_version(conn, self._t)

        return self._run("schema_version", op, write=False)

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

    # -- epoch and creates (stores.sql.creates) --------------------------------------------

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

    def create_unique(self, new: NewJob) -> CreateResult:
        return self._run("create_unique", self._create_unique_op(new))

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

    @property
    def enqueue_overlaps(self) -> bool:
        """Whether ``enqueue`` runs its ``meanwhile`` while the statement is on the way.

        On PostgreSQL through psycopg 3, where the statement runs alone (in
        autocommit), and on MySQL/MariaDB through PyMySQL
        (:mod:`~celery_exactonce.stores.sql.mysqlwire`); elsewhere
        ``meanwhile`` runs before the statement.
        """
        dialect = self._engine.dialect
        if dialect.name == "mysql" and dialect.driver == "pymysql":
            return sql_engine.pymysql_splits() and self._commits_alone()
        return self._postgresql and pgwire.splits() and self._commits_alone()

    def enqueue(self, new: NewJob, dispatch: Transition, *, meanwhile: Run = None) -> CreateResult:
        """The one-write submit: ``new`` created already ``DISPATCHED``, unless its ref exists.

        ``new`` is ``SCHEDULED`` and no occurrence; ``dispatch`` is its
        ``SCHEDULED → DISPATCHED`` (on ``new.rev``), applied in the same
        ``INSERT``: the record holds ``dispatch.new_rev`` and both history
        entries, stamped with the statement's store time. One statement and
        one commit (PostgreSQL: the statement alone, in autocommit): no read
        before it, no epoch. ``CREATED`` answers the record built here (not
        read back); a ref that exists answers ``EXISTS`` with the record as it
        is (a second statement). Repeating a call that applied answers
        ``EXISTS`` with a record whose ``rev`` is ``dispatch.new_rev``.
        ``meanwhile`` (the caller's message built) runs once: while the
        statement is on the way where it can (:attr:`enqueue_overlaps`), else first.
        """
        self._check_enqueue(new, dispatch)
        if self._commits_alone():  # the statement alone, on the driver
            returning = self._enqueue_returning()
            stmt, params = self._sql.enqueue(self._namespace, new, dispatch, returning=returning)
            row = self._run_statement("enqueue", stmt, params, meanwhile, keep=pgwire.AS_IS)
            if row is not None:  # inserted; without RETURNING, at this process's estimate
                now = times.from_micros(row[0]) if row else datetime.now(timezone.utc)
                return CreateResult(CreateStatus.CREATED, self._enqueued(new, dispatch, now))
            # The ref exists: the general way answers its record (its INSERT changes nothing).
        elif meanwhile is not None:
            meanwhile()
        return self._run("enqueue", self._enqueue_op(new, dispatch), autocommit=self._autocommit)

    def get(self, ref: JobRef) -> Job | None:
        return self._run("get", lambda conn: self._select_job(conn, ref), write=False)

    # -- transitions and notes (stores.sql.transitions) ------------------------------------

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
        """Rows locked in key order (no deadlock): one transaction for the batch, or, for a
        brief one on PostgreSQL, one statement, then a transaction for any row it left.

        A brief batch of transitions one statement can apply, on PostgreSQL
        (the worker gate's ``RUNNING`` CAS and a run's completion, one each;
        beat's chunks), is that statement alone, in autocommit on the driver:
        one round trip. A row it did not change is decided by the locking
        transaction (which answers the record).
        """
        if not requests:
            self._check_usable()
            return []
        return self._transition_many(requests, brief)

    def heartbeat(self, ref: JobRef, run_id: str) -> bool:
        stmt, params = self._sql.heartbeat(self._namespace, ref, run_id)
        return self._run(
            "heartbeat",
            lambda conn: bool(conn.execute(stmt, params).rowcount == 1),
            autocommit=self._autocommit,
        )

    def annotate(self, ref: JobRef, *, node: str, reason: str, op_id: str) -> bool:
        return self._run("annotate", self._annotate_op(ref, node, reason, op_id))

    # -- scans (stores.sql.scans) ----------------------------------------------------------

    def watermark(self, entry: str) -> datetime | None:
        return self.watermarks([entry]).get(entry)

    def watermarks(self, entries: Sequence[str]) -> dict[str, datetime]:
        if not entries:
            self._check_usable()
            return {}
        return self._run("watermarks", self._watermarks_op(entries), write=False)

    def note_skipped(self, skipped: Sequence[SkippedSlots]) -> None:
        if not skipped:
            self._check_usable()
            return
        self._run("note_skipped", self._note_skipped_op(skipped))

    def skipped(self, limit: int = 100) -> list[SkippedSlots]:
        op = self._skipped_op(limit)
        return self._run("skipped", op, write=False) if limit > 0 else self._empty([])

    def count_by_state(self) -> dict[State, int]:
        return self._run("count_by_state", self._count_by_state_op(), write=False)

    def due_backlog(self) -> DueBacklog:
        return self._run("due_backlog", self._due_backlog_op(), write=False)

    def list_stale(
        self,
        state: State,
        older_than: float,
        limit: int,
        *,
        after: tuple[datetime, JobRef] | None = None,
    ) -> list[Job]:
        op = self._list_stale_op(state, older_than, limit, after)
        return self._run("list_stale", op, write=False) if limit > 0 else self._empty([])

    def list_jobs(
        self,
        state: State,
        limit: int,
        *,
        after: tuple[datetime, JobRef] | None = None,
        older_than: float = 0.0,
        task: str | None = None,
        entry: str | None = None,
    ) -> list[Job]:
        op = self._list_stale_op(state, older_than, limit, after, task=task, entry=entry)
        return self._run("list_jobs", op, write=False) if limit > 0 else self._empty([])

    def find_ids(self, prefix: str, limit: int) -> list[JobRef]:
        op = self._find_ids_op(prefix, limit)
        return self._run("find_ids", op, write=False) if limit > 0 else self._empty([])

    def claim_due(self, limit: int, *, node: str, reason: str = "claimed") -> list[Job]:
        op = self._claim_due_op(limit, node, reason)
        return self._run("claim_due", op) if limit > 0 else self._empty([])

    def purge_expired(self, limit: int) -> int:
        op = self._purge_expired_op(limit)
        return self._run("purge_expired", op) if limit > 0 else self._empty(0)

    # -- leases (stores.sql.leases) --------------------------------------------------------

    def acquire_lease(self, name: str, token: str, ttl: float) -> bool:
        return self._run("acquire_lease", self._acquire_lease_op(name, token, ttl))

    def renew_lease(self, name: str, token: str, ttl: float) -> bool:
        return self._run("renew_lease", self._renew_lease_op(name, token, ttl))

    def release_lease(self, name: str, token: str) -> bool:
        return self._run("release_lease", self._release_lease_op(name, token))

    def lease(self, name: str) -> tuple[str, datetime] | None:
        return self._run("lease", self._lease_op(name), write=False)

    # -- stored beat entries (stores.sql.leases) -----------------------------------------

    def entries_revision(self) -> int:
        return self._run("entries_revision", self._entries_revision_op(), write=False)

    def read_entries(self) -> tuple[int, dict[str, str]]:
        return self._run("read_entries", self._read_entries_op(), write=False)

    def write_entry(
        self, name: str, definition: str | None, *, expect: str | Unchecked | None = UNCHECKED
    ) -> int | None:
        return self._run("write_entry", self._write_entry_op(name, definition, expect))
