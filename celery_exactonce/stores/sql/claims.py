"""Beat's claims on the SQL store: a batch's decided slots read first, the others created at once.

:class:`SqlClaims` is the part of :class:`~celery_exactonce.stores.sql.creates.SqlCreates`
that decides many claims (creates of occurrences) with few statements, for a
brief ``create_many``:

* :meth:`SqlClaims._decided`: one read of the epoch, the entries' watermarks
  and which records exist answers the claims another node decided already
  (``EXISTS``, ``BELOW_WATERMARK``), without a write or a lock;
* :meth:`SqlClaims._create_batch` (PostgreSQL): one statement creates the
  others (:meth:`~celery_exactonce.stores.sql.statements_batch.BatchStatements.create_batch`),
  each answered as its one-statement create would be (:meth:`SqlClaims._answer`).
  A claim it cannot decide (a create that committed after the statement
  began moved its mark) is left to the caller's one-row way.

Not here: the batch's transaction, its lock order and rereads, the one-row
and locking creates (:mod:`~celery_exactonce.stores.sql.creates`), the SQL
(:mod:`~celery_exactonce.stores.sql.statements_batch`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from celery_exactonce.core import jobs, times
from celery_exactonce.core.jobs import CreateResult, CreateStatus
from celery_exactonce.core.refs import Space
from celery_exactonce.core.writes import NewJob
from celery_exactonce.stores.sql import engine as sql_engine
from celery_exactonce.stores.sql.base import Slow
from celery_exactonce.stores.sql.shared import SqlShared


class SqlClaims(SqlShared):
    """A batch of claims decided with few statements (see the module docs)."""

    def _create_batch(
        self,
        conn: sa.Connection,
        news: Sequence[NewJob],
        order: Sequence[int],
        decided: Mapping[int, CreateResult],
        epoch: str | None,
        brief: bool,
    ) -> dict[int, CreateResult]:
        """The claims of ``news`` in ``order`` not yet ``decided``, created by one statement.

        Their answers by index, as each claim's one-row create would answer
        them; a claim that one statement cannot decide (a create that
        committed after the statement began moved its mark) is left out, for
        the caller to decide the one-row way. Nothing when the claims cannot
        be one statement (:meth:`BatchStatements.create_batch`).
        """
        todo = [i for i in order if i not in decided]
        batch = self._sql.create_batch(self._namespace, [news[i] for i in todo], epoch)
        if batch is None:
            return {}
        rows = self._one_statement(conn, *batch)
        answers = {}
        for row in rows:
            i = todo[row.i - 1]
            result = self._answer(conn, news[i], row, epoch, brief=brief)
            if result is not None:
                answers[i] = result
        return answers

    def _decided(
        self, conn: sa.Connection, news: Sequence[NewJob], indices: Sequence[int], epoch: str | None
    ) -> dict[int, CreateResult]:
        """The occurrences among ``news[i]`` that one read shows decided, by index.

        One statement reads the epoch, the entries' watermarks and which
        records exist. A slot whose record exists is ``EXISTS``; one at or
        below its entry's mark is ``BELOW_WATERMARK`` (marks only rise, and a
        record is created only above the mark, so neither answer can change).
        These are the answers a create would give, without a write or a lock:
        what every beat node but the first gets for most of a tick's claims.
        Nothing is decided when the epoch differs from ``epoch`` (each create
        answers the mismatch) or when no occurrence is among them.
        """
        todo = {  # index -> (entry, slot in microseconds)
            i: (news[i].entry, times.to_micros(fire))
            for i in indices
            if news[i].ref.space is Space.OCCURRENCE
            and news[i].entry is not None
            and (fire := news[i].fire_time) is not None
        }
        if not todo:
            return {}
        entries = sorted({str(entry) for entry, _ in todo.values()})
        ids = [news[i].ref.id for i in todo]
        query: sa.Executable
        if self._postgresql:  # each row by its key
            query, params = self._sql.decided(self._namespace, entries, ids)
        else:
            query, params = self._decided_query, {"k_ns": self._namespace}
            params.update(entries=entries, ids=ids)
        marks: dict[str, int | None] = {}
        found: set[str] = set()
        stored: str | None = None
        for kind, key, mark in conn.execute(query, params):
            if kind == "m":
                marks[key] = mark
            elif kind == "j":
                found.add(key)
            else:
                stored = key
        if stored is None or (epoch is not None and stored != epoch):
            return {}
        decided = {}
        for i, (entry, slot) in todo.items():
            mark = marks.get(str(entry))
            if news[i].ref.id in found:
                decided[i] = CreateResult(CreateStatus.EXISTS, epoch=stored)
            elif mark is not None and slot <= mark:
                decided[i] = CreateResult(CreateStatus.BELOW_WATERMARK, epoch=stored)
        return decided

    @functools.cached_property
    def _decided_query(self) -> sa.CompoundSelect[Any]:
        """The statement of :meth:`_decided` (built once): rows of ``(kind, key, mark)``."""
        wm, jobs_t, meta = self._t.watermarks, self._t.jobs, self._t.meta
        ns: sa.BindParameter[str] = sa.bindparam("k_ns")
        no_mark = sa.cast(sa.null(), sa.BigInteger)
        return sa.union_all(
            sa.select(sa.literal_column("'m'"), wm.c.entry, wm.c.fire_time).where(
                wm.c.namespace == ns, wm.c.entry.in_(sa.bindparam("entries", expanding=True))
            ),
            sa.select(sa.literal_column("'j'"), jobs_t.c.id, no_mark).where(
                jobs_t.c.namespace == ns,
                jobs_t.c.space == Space.OCCURRENCE.value,
                jobs_t.c.id.in_(sa.bindparam("ids", expanding=True)),
            ),
            sa.select(sa.literal_column("'e'"), meta.c.epoch, no_mark).where(
                meta.c.namespace == ns
            ),
        )

    @staticmethod
    def _one_statement(
        conn: sa.Connection, stmt: sa.TextClause | sa.TextualSelect, params: dict[str, Any]
    ) -> list[sa.Row[Any]]:
        """The rows of a one-statement create (PostgreSQL); :class:`Slow` when it failed whole."""
        try:
            return list(conn.execute(stmt, params))
        except sa_exc.IntegrityError as exc:
            if sql_engine.error_code(exc.orig) != sql_engine.UNIQUE_VIOLATION:
                raise
            raise Slow from None

    def _answer(
        self, conn: sa.Connection, new: NewJob, row: sa.Row[Any], epoch: str | None, *, brief: bool
    ) -> CreateResult | None:
        """What a one-statement create of ``new`` answered (its ``row``); ``None``: undecided."""
        stored = row.stored_
        if epoch is not None and stored != epoch:
            return CreateResult(CreateStatus.EPOCH_MISMATCH, epoch=stored)
        if row.created_:
            job = jobs.job_from_new(new, times.from_micros(row.now_))
            return CreateResult(CreateStatus.CREATED, job, epoch=stored)
        if row.id is not None:  # the record existed when the statement began
            if brief:
                return CreateResult(CreateStatus.EXISTS, epoch=stored)
            existing = self._select_job(conn, new.ref)  # the record as it is
            if existing is None:  # purged since: decide again
                return None
            return CreateResult(CreateStatus.EXISTS, existing, epoch=stored)
        # Marks only rise, and a record is created only above the mark: with the slot
        # at or below the mark the statement began with, no record can have appeared since.
        fire = times.to_micros_opt(new.fire_time)
        if fire is not None and row.mark_ is not None and fire <= row.mark_:
            return CreateResult(CreateStatus.BELOW_WATERMARK, epoch=stored)
        # A create that committed after this statement began (and so is not in its
        # snapshot) made the record or moved the mark: the transaction reads them.
        return None
