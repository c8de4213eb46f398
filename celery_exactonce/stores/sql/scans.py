"""The SQL store's scans: the operations that read or sweep many rows of a namespace.

:class:`SqlScans` is the part of :class:`~celery_exactonce.stores.sql.store.SqlStore`
that builds, inside its transaction, each operation over many rows:

* **watermarks**: the marks of many entries, read in ``IN (...)`` lists of
  :data:`_IN_CHUNK` (below every dialect's bound-parameter limit);
* **stale jobs**: the records of a state not touched for a while, oldest
  first, paged by a ``(touched_at, ref)`` cursor: one query per key space,
  each bounded by the index on ``(namespace, state, space, touched_at)``
  and ordered by it, merged here (and, for people, those of one task or beat
  entry);
* **jobs per state**: counted in one ``GROUP BY``;
* **due jobs, claimed**: ``PENDING`` records whose ``run_at`` has come, moved
  to ``SCHEDULED`` in the same transaction (``SKIP LOCKED``: concurrent
  claimers take different rows);
* **expired jobs, purged**: per terminal state and key space, the records
  that ended more than their retention ago (``touched_at``, on the same
  index: nothing touches a terminal record again), oldest first, those past
  their ``expires_at`` deleted (``SKIP LOCKED`` too);
* **counts**: the records per state and the due backlog, read for gauges
  from the ``(namespace, state, …)`` indexes;
* **ids by prefix**: per key space, the first ``limit`` ids at or after the
  prefix on the primary key (ids compare by code point on every dialect), of
  which those that start with it.

A query's state is written into its SQL (a constant of the code, never
input), so that PostgreSQL, planning a statement whatever its parameters,
knows which of the partial indexes (:func:`~celery_exactonce.stores.sql.schema.job_indexes`)
holds its rows.

Each ``_…_op`` method checks its arguments and returns the transaction's
function, as the operation did before running it.

Not here: running those transactions (:mod:`~celery_exactonce.stores.sql.store`,
:mod:`~celery_exactonce.stores.sql.base`), reading one record by its key
(:meth:`~celery_exactonce.stores.sql.base.SqlCore._select_job`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from celery_exactonce.core import jobs, refs, times
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef, Space
from celery_exactonce.core.skipped_slots import SkippedSlots
from celery_exactonce.core.states import LIVE, TERMINAL, State
from celery_exactonce.core.writes import Transition
from celery_exactonce.stores.base import DueBacklog
from celery_exactonce.stores.sql.shared import SqlShared

#: Identifiers per ``IN (...)`` list: below every dialect's bound-parameter limit.
_IN_CHUNK = 500


def _state(state: State) -> sa.BindParameter[str]:
    """``state`` written into the statement's SQL (see the module docs)."""
    return sa.literal(state.value, literal_execute=True)


def _past(
    c: sa.ColumnCollection[str, sa.Column[Any]], space: Space, after: tuple[int, JobRef]
) -> list[sa.ColumnElement[bool]]:
    """``(touched_at, space, id) > after`` for the jobs of ``space``, spelt so that
    ``touched_at >= t`` bounds the index scan."""
    t, ref = after
    if space.value > ref.space.value:
        return [c.touched_at >= t]
    if space.value < ref.space.value:
        return [c.touched_at > t]
    return [c.touched_at >= t, sa.or_(c.touched_at > t, c.id > ref.id)]


class SqlScans(SqlShared):
    """Watermarks, stale, due and expired jobs, inside their transaction."""

    def _note_skipped_op(self, skipped: Sequence[SkippedSlots]) -> Callable[[sa.Connection], None]:
        """The transaction of ``note_skipped``: the records, and the expired ones pruned."""
        table = self._t.skipped

        def op(conn: sa.Connection) -> None:
            now = self._now(conn)
            conn.execute(
                table.insert(),
                [
                    {
                        "namespace": self._namespace,
                        "entry": r.entry,
                        "reason": r.where,
                        "first_slot": times.to_micros(r.first),
                        "last_slot": times.to_micros(r.last),
                        "slots": r.count,
                        "node": r.node,
                        "noted_at": now,
                    }
                    for r in skipped
                ],
            )
            conn.execute(
                table.delete().where(
                    table.c.namespace == self._namespace,
                    table.c.noted_at < now - int(self._retention * 1_000_000),
                )
            )

        return op

    def _skipped_op(self, limit: int) -> Callable[[sa.Connection], list[SkippedSlots]]:
        """The transaction of ``skipped``: the newest records within the retention."""
        table = self._t.skipped

        def op(conn: sa.Connection) -> list[SkippedSlots]:
            cutoff = self._now(conn) - int(self._retention * 1_000_000)
            query = (
                sa.select(table)
                .where(table.c.namespace == self._namespace, table.c.noted_at >= cutoff)
                .order_by(table.c.seq.desc())
                .limit(limit)
            )
            return [
                SkippedSlots(
                    entry=row.entry,
                    where=row.reason,
                    first=times.from_micros(row.first_slot),
                    last=times.from_micros(row.last_slot),
                    count=int(row.slots),
                    node=row.node,
                    at=times.from_micros(row.noted_at),
                )
                for row in conn.execute(query)
            ]

        return op

    def _watermarks_op(
        self, entries: Sequence[str]
    ) -> Callable[[sa.Connection], dict[str, datetime]]:
        """The transaction of ``watermarks`` (at least one entry)."""
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
                    (row.entry, times.from_micros(row.fire_time)) for row in conn.execute(query)
                )
            return found

        return op

    def _find_ids_op(self, prefix: str, limit: int) -> Callable[[sa.Connection], list[JobRef]]:
        """The transaction of ``find_ids`` (the prefix checked first)."""
        refs.validate_identifier(prefix, "job id prefix", refs.MAX_ID_LENGTH)
        c = self._t.jobs.c

        def op(conn: sa.Connection) -> list[JobRef]:
            found: list[JobRef] = []
            for space in sorted(Space, key=lambda s: s.value):
                ids = conn.execute(
                    sa.select(c.id)
                    .where(c.namespace == self._namespace, c.space == space.value, c.id >= prefix)
                    .order_by(c.id)
                    .limit(max(limit, 0))
                ).scalars()
                found.extend(JobRef(space, i) for i in ids if i.startswith(prefix))
            return found[: max(limit, 0)]

        return op

    def _list_stale_op(
        self,
        state: State,
        older_than: float,
        limit: int,
        after: tuple[datetime, JobRef] | None,
        *,
        task: str | None = None,
        entry: str | None = None,
    ) -> Callable[[sa.Connection], list[Job]]:
        """The transaction of ``list_stale`` (the state and the cursor checked first).

        And of ``list_jobs``: with ``task`` or ``entry``, only the jobs of them.
        """
        state = State(state)
        c = self._t.jobs.c
        cursor = None if after is None else (times.to_micros(after[0]), after[1])
        filters: list[sa.ColumnElement[bool]] = []
        if task is not None:
            filters.append(c.task == task)
        if entry is not None:
            filters.append(c.entry == entry)

        def op(conn: sa.Connection) -> list[Job]:
            cutoff = self._now(conn) - round(older_than * 1_000_000)
            found: list[Job] = []
            for space in Space:
                past = [] if cursor is None else _past(c, space, cursor)
                rows = conn.execute(
                    sa.select(self._t.jobs)
                    .where(
                        c.namespace == self._namespace,
                        c.state == _state(state),
                        c.space == space.value,
                        c.touched_at <= cutoff,
                        *past,
                        *filters,
                    )
                    .order_by(c.touched_at, c.id)
                    .limit(limit)
                )
                found.extend(self._job(row) for row in rows)
            # (space, id) orders as str(ref) does: the space is one character, then ':'.
            found.sort(key=lambda job: (job.touched_at, job.ref.space.value, job.ref.id))
            return found[:limit]

        return op

    def _claim_due_op(
        self, limit: int, node: str, reason: str
    ) -> Callable[[sa.Connection], list[Job]]:
        """The transaction of ``claim_due`` (the node and reason checked first)."""

        def claim() -> Transition:
            return Transition(State.SCHEDULED, frozenset({State.PENDING}), node=node, reason=reason)

        claim()  # validates node and reason before anything is read
        table, c = self._t.jobs, self._t.jobs.c

        def op(conn: sa.Connection) -> list[Job]:
            now = self._now(conn)
            query = (
                sa.select(table)
                .where(
                    c.namespace == self._namespace,
                    c.state == _state(State.PENDING),
                    c.run_at <= now,
                )
                .order_by(c.run_at, c.space, c.id)
                .limit(limit)
            )
            if self._d.locks:
                query = query.with_for_update(skip_locked=True)
            due = [self._job(row) for row in conn.execute(query)]
            claimed = [jobs.apply_transition(job, claim(), times.from_micros(now)) for job in due]
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

        return op

    def _purge_expired_op(self, limit: int) -> Callable[[sa.Connection], int]:
        """The transaction of ``purge_expired``: per terminal state and key space.

        A terminal record's ``expires_at`` is its end (or its slot, if later)
        plus the retention of its key space (:meth:`Compaction.retention_of`),
        and its ``touched_at`` is its end. So the records of one state and key
        space that ended more than that retention ago are found on the index,
        oldest first, and those past their ``expires_at`` deleted; a record
        whose slot is later than its end is passed over until its slot's
        retention is over. A record written with a shorter retention than this
        process's waits for this one (kept longer, never purged early).
        """
        table, c = self._t.jobs, self._t.jobs.c
        kept = self._compaction.occurrence_retention
        retention = {
            space: self._retention
            if kept is None or space is not Space.OCCURRENCE
            else min(self._retention, kept)
            for space in Space
        }

        def op(conn: sa.Connection) -> int:
            now, purged = self._now(conn), 0
            for state in sorted(TERMINAL):
                for space in Space:
                    if purged >= limit:
                        return purged
                    expired = (
                        c.namespace == self._namespace,
                        c.state == _state(state),
                        c.space == space.value,
                        c.touched_at <= now - int(retention[space] * 1_000_000),
                        c.expires_at <= now,
                    )
                    query = (
                        sa.select(c.id).where(*expired).order_by(c.touched_at).limit(limit - purged)
                    )
                    if self._d.locks:
                        query = query.with_for_update(skip_locked=True)
                    ids = list(conn.execute(query).scalars())
                    if ids:
                        done = conn.execute(table.delete().where(*expired, c.id.in_(ids)))
                        purged += int(done.rowcount)
            return purged

        return op

    def _count_by_state_op(self) -> Callable[[sa.Connection], dict[State, int]]:
        """The transaction of ``count_by_state``: a ``GROUP BY`` of the live states and one
        of the terminal ones, each on its index (PostgreSQL's partial ones)."""
        c = self._t.jobs.c

        def op(conn: sa.Connection) -> dict[State, int]:
            counts = dict.fromkeys(State, 0)
            for states in (LIVE, TERMINAL):
                query = (
                    sa.select(c.state, sa.func.count())
                    .where(
                        c.namespace == self._namespace,
                        c.state.in_([_state(s) for s in sorted(states)]),
                    )
                    .group_by(c.state)
                )
                for state, n in conn.execute(query):
                    counts[State(state)] = int(n)
            return counts

        return op

    def _due_backlog_op(self) -> Callable[[sa.Connection], DueBacklog]:
        """The transaction of ``due_backlog``: a count and a ``min`` on the due index."""
        c = self._t.jobs.c

        def op(conn: sa.Connection) -> DueBacklog:
            now = self._now(conn)
            count, oldest = conn.execute(
                sa.select(sa.func.count(), sa.func.min(c.run_at)).where(
                    c.namespace == self._namespace,
                    c.state == _state(State.PENDING),
                    c.run_at <= now,
                )
            ).one()
            first = None if oldest is None else times.from_micros(int(oldest))
            return DueBacklog(int(count), first, times.from_micros(now))

        return op
