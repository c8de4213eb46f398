"""The SQL store's scans: the operations that read or sweep many rows of a namespace.

:class:`SqlScans` is the part of :class:`~celery_exactonce.stores.sql.store.SqlStore`
that builds, inside its transaction, each operation over many rows:

* **watermarks**: the marks of many entries, read in ``IN (...)`` lists of
  :data:`_IN_CHUNK` (below every dialect's bound-parameter limit);
* **stale jobs**: the records of a state not touched for a while, oldest
  first, paged by a ``(touched_at, ref)`` cursor spelt so that the index on
  ``(namespace, state, touched_at)`` bounds the scan (and, for people, those
  of one task or beat entry);
* **jobs per state**: counted in one ``GROUP BY``;
* **due jobs, claimed**: ``PENDING`` records whose ``run_at`` has come, moved
  to ``SCHEDULED`` in the same transaction (``SKIP LOCKED``: concurrent
  claimers take different rows);
* **expired jobs, purged**: records past their ``expires_at``, deleted
  (``SKIP LOCKED`` too);
* **counts**: the records per state and the due backlog, read for gauges
  from the ``(namespace, state, …)`` indexes;
* **ids by prefix**: per key space, the first ``limit`` ids at or after the
  prefix on the primary key (ids compare by code point on every dialect), of
  which those that start with it.

Each ``_…_op`` method checks its arguments and returns the transaction's
function, as the operation did before running it.

Not here: running those transactions (:mod:`~celery_exactonce.stores.sql.store`,
:mod:`~celery_exactonce.stores.sql.base`), reading one record by its key
(:meth:`~celery_exactonce.stores.sql.base.SqlCore._select_job`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime

import sqlalchemy as sa

from celery_exactonce.core import jobs, refs, times
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef, Space
from celery_exactonce.core.skipped_slots import SkippedSlots
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import Transition
from celery_exactonce.stores.base import DueBacklog
from celery_exactonce.stores.sql.base import SqlCore

#: Identifiers per ``IN (...)`` list: below every dialect's bound-parameter limit.
_IN_CHUNK = 500


class SqlScans(SqlCore):
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
        # (space, id) orders as str(ref) does: the space is one character, then ':'.
        past: list[sa.ColumnElement[bool]] = []
        if after is not None:
            # (touched_at, space, id) > the cursor, spelt so that the index on
            # (namespace, state, touched_at) bounds the scan: touched_at >= t.
            t, ref = times.to_micros(after[0]), after[1]
            past = [
                c.touched_at >= t,
                sa.or_(
                    c.touched_at > t,
                    c.space > ref.space.value,
                    sa.and_(c.space == ref.space.value, c.id > ref.id),
                ),
            ]
        if task is not None:
            past.append(c.task == task)
        if entry is not None:
            past.append(c.entry == entry)

        def op(conn: sa.Connection) -> list[Job]:
            cutoff = self._now(conn) - round(older_than * 1_000_000)
            rows = conn.execute(
                sa.select(self._t.jobs)
                .where(
                    c.namespace == self._namespace,
                    c.state == state.value,
                    c.touched_at <= cutoff,
                    *past,
                )
                .order_by(c.touched_at, c.space, c.id)
                .limit(limit)
            )
            return [self._job(row) for row in rows]

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
                    c.namespace == self._namespace, c.state == State.PENDING.value, c.run_at <= now
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
        """The transaction of ``purge_expired``."""
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

        return op

    def _count_by_state_op(self) -> Callable[[sa.Connection], dict[State, int]]:
        """The transaction of ``count_by_state``: one ``GROUP BY`` on the state index."""
        c = self._t.jobs.c

        def op(conn: sa.Connection) -> dict[State, int]:
            counts = dict.fromkeys(State, 0)
            query = (
                sa.select(c.state, sa.func.count())
                .where(c.namespace == self._namespace)
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
                    c.state == State.PENDING.value,
                    c.run_at <= now,
                )
            ).one()
            first = None if oldest is None else times.from_micros(int(oldest))
            return DueBacklog(int(count), first, times.from_micros(now))

        return op
