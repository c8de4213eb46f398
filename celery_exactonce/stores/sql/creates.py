"""The SQL store's creates: a job created if absent, and the namespace epoch every create checks.

:class:`SqlCreates` is the part of :class:`~celery_exactonce.stores.sql.store.SqlStore`
that decides a create inside its transaction. A create goes one of two ways:

* **one statement** (PostgreSQL, any job; MariaDB ≥ 10.5 with
  ``INSERT … RETURNING``, jobs that are not occurrences):
  :meth:`SqlCreates._create_fast` runs the ``INSERT … SELECT`` of
  :mod:`~celery_exactonce.stores.sql.statements_base`, which checks the
  epoch (and, on PostgreSQL, advances an occurrence's watermark in the same
  statement).
  What one statement cannot decide (a record a competing create committed
  after the statement began; on MariaDB a duplicate key or another epoch) it
  leaves, having written nothing, to the locking way;
* **locking** (:meth:`SqlCreates._create`): read the clock and the epoch;
  for an occurrence, lock its entry's watermark row (creates of one entry
  queue there), look for the record and check the mark; insert; raise the
  mark.

A batch (``create_many``) takes its locks in entry order (:func:`_lock_order`),
so two batches never deadlock. On PostgreSQL its claims are first created by
one statement for the whole batch (:mod:`~celery_exactonce.stores.sql.claims`,
rows in lock order); a claim that statement leaves undecided goes the one-row
way, then the locking way. Once a one-statement create aborts the batch's
transaction, the batch runs again the locking way.

Not here: which transaction a create runs in (autocommit or not, one create
or a batch: :mod:`~celery_exactonce.stores.sql.store`), running and retrying it
(:mod:`~celery_exactonce.stores.sql.base`), the statements' SQL
(:mod:`~celery_exactonce.stores.sql.statements_base`), a batch's decided
claims and its one statement (:mod:`~celery_exactonce.stores.sql.claims`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from celery_exactonce.core import exceptions, jobs, refs, times
from celery_exactonce.core.jobs import CreateResult, CreateStatus
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.stores.sql import engine as sql_engine
from celery_exactonce.stores.sql.base import Rerun, Slow
from celery_exactonce.stores.sql.claims import SqlClaims

#: How many times a brief batch reads its undecided claims again (see ``_create_many_op``).
REREADS = 4

#: Answers that mean another create holds the slot: the rest of the batch may be decided too.
_TAKEN = frozenset({CreateStatus.EXISTS, CreateStatus.BELOW_WATERMARK})


def _lock_order(new: NewJob) -> tuple[str, str]:
    """The order a batch of creates takes its locks in (sorted stably: by entry, then id).

    An occurrence's watermark row serialises the creates of its entry, which
    keep the batch's order among themselves; other jobs go by id.
    """
    return (new.entry or "", "" if new.entry else str(new.ref))


class SqlCreates(SqlClaims):
    """Creates and the epoch, inside their transaction."""

    def _epoch_op(self, replace: str | None) -> Callable[[sa.Connection], str]:
        """The transaction of ``epoch``: the one stored, set when absent or replaced."""
        meta = self._t.meta
        query = sa.select(meta.c.epoch).where(meta.c.namespace == self._namespace)

        def op(conn: sa.Connection) -> str:
            stored = conn.execute(query).scalar_one_or_none()
            if stored is not None and (replace is None or stored != replace):
                return str(stored)
            epoch = f"{refs.new_token()}{refs.EPOCH_SEPARATOR}{self._now(conn)}"
            if stored is None:
                self._insert_absent(conn, meta, {"namespace": self._namespace, "epoch": epoch})
            else:  # a CAS on the epoch read: of two replacers, one wins
                conn.execute(
                    sa.update(meta)
                    .where(meta.c.namespace == self._namespace, meta.c.epoch == replace)
                    .values(epoch=epoch)
                )
            return str(conn.execute(query).scalar_one())

        return op

    def _create_many_op(
        self, news: Sequence[NewJob], epoch: str | None, brief: bool
    ) -> Callable[[sa.Connection], list[CreateResult]]:
        """The transaction of ``create_many`` (a batch that is not empty).

        A brief batch first reads which of its claims are decided already
        (:meth:`_decided`): only the others are created one by one. When one of
        those finds its slot taken (another node's batch got there first), the
        rest are read again, up to :data:`REREADS` times a batch.
        """
        order = sorted(range(len(news)), key=lambda i: _lock_order(news[i]))
        fast = True  # until a statement fails in a way that aborts the transaction

        def op(conn: sa.Connection) -> list[CreateResult]:
            nonlocal fast
            results: dict[int, CreateResult] = {}
            clock: tuple[int, str | None] | None = None  # once for the locking creates
            rereads = REREADS if brief else 0
            if brief:
                results.update(self._decided(conn, news, order, epoch))
            if fast and self._postgresql:
                try:
                    results.update(self._create_batch(conn, news, order, results, epoch, brief))
                except Slow:
                    fast = False  # the transaction is aborted: run the batch again, locking
                    raise Rerun from None
            for n, i in enumerate(order):
                if i in results:
                    continue
                result = None
                if fast and self._fast_create(news[i]):
                    try:
                        result = self._create_fast(conn, news[i], epoch, brief=brief)
                    except Slow:
                        fast = False  # the transaction is aborted: run the batch again, locking
                        raise Rerun from None
                if result is None:
                    clock = clock or self._clock_and_epoch(conn)
                    result = self._create(conn, news[i], epoch, clock)
                results[i] = result
                later = [j for j in order[n + 1 :] if j not in results]
                if rereads > 0 and result.status in _TAKEN and later:
                    rereads -= 1
                    results.update(self._decided(conn, news, later, epoch))
            return [results[i] for i in range(len(news))]

        return op

    def _create_one(self, conn: sa.Connection, new: NewJob, epoch: str | None) -> CreateResult:
        """``create`` in a transaction that goes on after a failed statement (MySQL)."""
        result = (
            self._create_fast(conn, new, epoch, brief=False) if self._fast_create(new) else None
        )
        return result if result is not None else self._create(conn, new, epoch)

    def _fast_create(self, new: NewJob) -> bool:
        """Whether ``new`` is created by one statement (else by the locking transaction)."""
        if self._postgresql:
            return True
        return new.entry is None and self._insert_returning()

    def _insert_returning(self) -> bool:
        """MariaDB 10.5 and later (``INSERT … RETURNING``); MySQL has none."""
        dialect = self._engine.dialect
        version = getattr(dialect, "server_version_info", None) or (0,)
        return bool(getattr(dialect, "is_mariadb", False)) and version >= (10, 5)

    def _create_fast(
        self, conn: sa.Connection, new: NewJob, epoch: str | None, *, brief: bool
    ) -> CreateResult | None:
        """``create`` in one statement; ``None`` when it cannot tell (nothing was written).

        Raises :class:`Slow` when the statement failed whole on PostgreSQL (an
        occurrence whose record another entry's create made): the transaction
        it ran in is aborted.
        """
        if not self._postgresql:
            stmt, params = self._sql.create_returning(self._namespace, new, epoch)
            try:
                row = conn.execute(stmt, params).first()
            except sa_exc.IntegrityError as exc:
                if sql_engine.error_code(exc.orig) != sql_engine.DUPLICATE_KEY:
                    raise
                # The row was selected, so the epoch matched. In a caller's transaction the
                # record may be newer than its snapshot: the transaction reads it currently.
                if brief and epoch is not None and self.owns_transactions:
                    return CreateResult(CreateStatus.EXISTS, epoch=epoch)
                return None  # the record as it is, and the epoch: the transaction reads them
            if row is None:  # the epoch differs: the transaction reads the one stored
                return None
            job = jobs.job_from_new(new, times.from_micros(row.now_))
            return CreateResult(CreateStatus.CREATED, job, epoch=row.stored_)
        stmt, params = self._sql.create_postgresql(self._namespace, new, epoch)
        row = self._one_statement(conn, stmt, params)[0]
        return self._answer(conn, new, row, epoch, brief=brief)

    def _enqueue_op(
        self, new: NewJob, dispatch: Transition
    ) -> Callable[[sa.Connection], CreateResult]:
        """The transaction of ``enqueue``: one ``INSERT``, and a read only when the key exists."""

        def op(conn: sa.Connection) -> CreateResult:
            returning = self._enqueue_returning()
            stmt, params = self._sql.enqueue(self._namespace, new, dispatch, returning=returning)
            try:
                result = conn.execute(stmt, params)
            except sa_exc.IntegrityError as exc:
                if sql_engine.error_code(exc.orig) != sql_engine.DUPLICATE_KEY:
                    raise
            else:
                row = result.first() if returning else None
                if row is not None or not returning:
                    # MySQL without RETURNING: inserted (no duplicate key); the times of the
                    # record answered are this process's estimate of the store's
                    now = times.from_micros(row.now_) if row else datetime.now(timezone.utc)
                    return CreateResult(CreateStatus.CREATED, self._enqueued(new, dispatch, now))
            existing = self._select_existing(conn, new.ref)
            if existing is None:  # purged since the insert met it: try again
                raise Rerun
            return CreateResult(CreateStatus.EXISTS, existing)

        return op

    def _enqueue_returning(self) -> bool:
        """Whether ``enqueue``'s ``INSERT`` answers its row (all but MySQL before MariaDB 10.5)."""
        return self._postgresql or self._engine.dialect.name == "sqlite" or self._insert_returning()

    @staticmethod
    def _check_enqueue(new: NewJob, dispatch: Transition) -> None:
        """``InvalidRequest`` unless ``new`` is ``SCHEDULED`` and ``dispatch`` its dispatch."""
        if new.entry is not None or new.state is not State.SCHEDULED:
            raise exceptions.InvalidRequest(f"enqueue of {new.ref}: a SCHEDULED job, no occurrence")
        if dispatch.to is not State.DISPATCHED or dispatch.expect != {State.SCHEDULED}:
            raise exceptions.InvalidRequest(f"enqueue of {new.ref}: SCHEDULED -> DISPATCHED only")

    @staticmethod
    def _enqueued(new: NewJob, dispatch: Transition, now: datetime) -> jobs.Job:
        """The record an ``enqueue`` wrote at store time ``now``, built here, not read back."""
        return jobs.enqueued_job(new, dispatch, now)

    def _clock_and_epoch(self, conn: sa.Connection) -> tuple[int, str | None]:
        """The store's time (microseconds) and the namespace's epoch, in one statement."""
        meta = self._t.meta
        stored_epoch = (
            sa.select(meta.c.epoch).where(meta.c.namespace == self._namespace).scalar_subquery()
        )
        now, stored = conn.execute(sa.select(self._now_col, stored_epoch)).one()
        return now, stored

    def _create(
        self,
        conn: sa.Connection,
        new: NewJob,
        epoch: str | None,
        clock: tuple[int, str | None] | None = None,
    ) -> CreateResult:
        wm = self._t.watermarks
        now, stored = clock if clock is not None else self._clock_and_epoch(conn)
        if epoch is not None and stored != epoch:
            return CreateResult(CreateStatus.EPOCH_MISMATCH, epoch=stored)
        mark: int | None = None
        occurrence = new.entry is not None and new.fire_time is not None
        if new.entry is not None and new.fire_time is not None:
            # Lock the entry's watermark first: creates of one entry queue
            # here, so the existence check below sees the winner's record.
            where = (wm.c.namespace == self._namespace, wm.c.entry == new.entry)
            values = {"namespace": self._namespace, "entry": new.entry, "fire_time": None}
            mark = self._lock_or_insert(conn, wm, where, values).fire_time
        # An occurrence checks for its record before its watermark (an existing record
        # answers EXISTS even below the mark); any other job just tries the insert.
        existing = self._select_job(conn, new.ref) if occurrence else None
        if existing is not None:
            return CreateResult(CreateStatus.EXISTS, existing, epoch=stored)
        if (
            new.fire_time is not None
            and mark is not None
            and times.to_micros(new.fire_time) <= mark
        ):
            return CreateResult(CreateStatus.BELOW_WATERMARK, epoch=stored)
        job = jobs.job_from_new(new, times.from_micros(now))
        if not self._insert_absent(conn, self._t.jobs, self._values(job)):
            existing = self._select_existing(conn, new.ref)
            if existing is None:
                raise Rerun
            return CreateResult(CreateStatus.EXISTS, existing, epoch=stored)
        if occurrence:
            conn.execute(
                wm.update()
                .where(wm.c.namespace == self._namespace, wm.c.entry == new.entry)
                .values(fire_time=times.to_micros_opt(new.fire_time))
            )
        return CreateResult(CreateStatus.CREATED, job, epoch=stored)

    def _create_unique_op(self, new: NewJob) -> Callable[[sa.Connection], CreateResult]:
        """The transaction of ``create_unique``: the key's row locked (the unique creates of
        one key queue there), its holder read, then the create, which becomes the holder."""
        key = new.unique
        if key is None:
            raise exceptions.InvalidRequest(f"job {new.ref}: a unique create needs a key")
        unique = self._t.unique
        where = (unique.c.namespace == self._namespace, unique.c.ukey == key)
        values = {"namespace": self._namespace, "ukey": key, "holder": ""}

        def op(conn: sa.Connection) -> CreateResult:
            holder = self._lock_or_insert(conn, unique, where, values).holder
            # The job's own record answers EXISTS (a repeat, a resubmitted task id), whoever
            # holds the key; the holder is read as committed, not as a caller's snapshot.
            if holder and holder != str(new.ref) and self._select_existing(conn, new.ref) is None:
                job = self._select_existing(conn, refs.JobRef.parse(holder))
                if job is not None and not job.state.terminal:
                    return CreateResult(CreateStatus.UNIQUE_HELD, job)
            result = self._create(conn, new, None)
            if result.created:
                conn.execute(unique.update().where(*where).values(holder=str(new.ref)))
            return result

        return op

    def _lock_or_insert(
        self,
        conn: sa.Connection,
        table: sa.Table,
        where: tuple[sa.ColumnElement[bool], ...],
        values: dict[str, Any],
    ) -> sa.Row[Any]:
        """The row ``where`` names, locked; inserted with ``values`` first when absent."""
        row = self._locked(conn, table, where)
        if row is None:
            self._insert_absent(conn, table, values)
            row = self._locked(conn, table, where)
            if row is None:
                raise Rerun
        return row
