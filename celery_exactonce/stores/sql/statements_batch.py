# ruff: noqa: S608 - only quoted table and column names and fixed SQL are formatted into a
# statement here; every value is a bound parameter.
"""Batches in one round trip, on PostgreSQL: :class:`BatchStatements`.

**Claims.** A brief batch of beat's claims (``create_many`` of occurrences,
each of its own entry) is one statement, :meth:`BatchStatements.create_batch`:
the one-statement create of :mod:`~celery_exactonce.stores.sql.statements_create`
for every row at once, its per-row values bound as arrays and read through
``unnest(...) WITH ORDINALITY``. It checks the epoch once, reads each row's
record and watermark as the statement found them, advances each mark that
is below its slot (``INSERT … ON CONFLICT DO UPDATE … WHERE``, rows taken in
the batch's order, so in lock order) where no record exists, inserts the
record of each mark it advanced, and answers one row per claim, as the
one-row create does. The record and the mark are read by a subquery per row
(the key's lookup, whatever the statistics say), never by a join a planner
could turn into a read of the namespace. Planned once per batch, where the
one-row statements were planned once per claim (the store plans every run,
see :mod:`~celery_exactonce.stores.sql.engine`).

**Transitions.**

A brief ``transition_many`` (beat's and the dispatcher's ``DISPATCHED`` and
``PUBLISHED`` writes of a chunk) would otherwise wait for one guarded
``UPDATE`` per job, one after the other. On PostgreSQL with psycopg 3, the
batch is the same one-row ``UPDATE`` of
:mod:`~celery_exactonce.stores.sql.statements`, once per job, sent as one
``executemany`` in pipeline mode: every statement sent before the first
answer is read, so the batch waits for the network once. Each row is
decided by its own one-row statement, with the plan that statement has
(the primary key), and the statements run in the order given, in one
transaction: the compare-and-swap per row is the one-row statement's.

Only a batch whose transitions share one shape (the same statement text:
the same guards, target, lease...) goes this way; any other goes one row
at a time.

A single ``UPDATE … FROM unnest(<arrays>)`` was tried first: PostgreSQL
planned it from the namespace (a new namespace looks rare to its
statistics) and read every job of the namespace for each batch, 0.3 s a
batch of 32 with 10,000 jobs. The pipeline keeps each row on its key.

Not here: what a row the statement did not change means (the store decides
it again the locking way, :mod:`~celery_exactonce.stores.sql.transitions`),
the one-row statement (:mod:`~celery_exactonce.stores.sql.statements`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from celery_exactonce.core.refs import JobRef, Space
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.stores.sql import schema as sql_schema
from celery_exactonce.stores.sql.statements import Statements
from celery_exactonce.stores.sql.statements_base import _INTEGERS, JOB_COLUMNS

#: The answers of :meth:`BatchStatements.create_batch`, one row per claim.
CREATE_ANSWERS = ("i", "now_", "stored_", "created_", "mark_", "id")


class BatchStatements(Statements):
    """:class:`Statements`, and a brief batch of transitions as one pipeline (PostgreSQL)."""

    def __init__(
        self, dialect: sa.Dialect, tables: sql_schema.Tables, now: str, retention: float
    ) -> None:
        super().__init__(dialect, tables, now, retention)
        self._dialect = dialect
        # A pipeline needs psycopg 3 (its ``executemany(returning=True)``) and a libpq
        # that has pipeline mode.
        self._pipeline = self._pg and dialect.driver == "psycopg" and _pipeline_supported()
        self._compiled: dict[tuple[Any, ...], str] = {}

    def transition_batch(
        self, namespace: str, items: Sequence[tuple[JobRef, Transition]]
    ) -> tuple[str, list[dict[str, Any]]] | None:
        """The driver's SQL of the one-row brief statement, and each item's parameters.

        ``None`` when the items do not go as one pipeline: not PostgreSQL on
        psycopg 3 with pipeline mode, fewer than two items, shapes that differ.
        """
        if not self._pipeline or len(items) < 2:
            return None
        parts = [self._transition_parts(namespace, ref, t, brief=True) for ref, t in items]
        shape = parts[0][0]
        if any(other != shape for other, _ in parts[1:]):
            return None
        sql = self._compiled.get(shape)
        if sql is None:
            stmt, _ = self.transition(namespace, items[0][0], items[0][1], brief=True)
            sql = self._compiled[shape] = str(stmt.compile(dialect=self._dialect))
        return sql, [params for _, params in parts]

    def create_batch(
        self, namespace: str, news: Sequence[NewJob], epoch: str | None
    ) -> tuple[sa.TextClause | sa.TextualSelect, dict[str, Any]] | None:
        """One statement creating every claim of ``news``, in the order given; ``None``: not one.

        Answers a row per claim: ``i`` (its 1-based position), then what the
        one-row create answers (``now_``, ``stored_``, ``created_``, ``mark_``,
        ``id``). ``None`` when the claims cannot be one statement: not
        PostgreSQL, fewer than two, any that is not an occurrence, an entry
        twice (a mark is advanced once a statement), states that differ.
        """
        if not self._pg or len(news) < 2:
            return None
        running = news[0].state is State.RUNNING
        if any(
            new.ref.space is not Space.OCCURRENCE
            or new.entry is None
            or new.fire_time is None
            or (new.state is State.RUNNING) is not running
            for new in news
        ) or len({new.entry for new in news}) != len(news):
            return None
        parts = [self._create_params(namespace, new, epoch) for new in news]
        for params in parts:  # the history is written from its pieces (h_0, h_1...)
            del params["c_history"]
        first = parts[0]
        if any(params.keys() != first.keys() for params in parts[1:]):
            return None  # (histories of one length: one shape)
        rows = tuple(
            sorted(
                name
                for name in first
                if name in ("k_id", "c_entry", "c_fire_time")
                or any(params[name] != first[name] for params in parts[1:])
            )
        )
        bound = {name: value for name, value in first.items() if name not in rows}
        bound.update((f"a_{name}", [params[name] for params in parts]) for name in rows)
        shape = ("create_batch", running, epoch is not None, rows)
        build = functools.partial(self._create_batch_sql, running, epoch, rows)
        return self._text(shape, build, CREATE_ANSWERS), bound

    def _create_batch_sql(self, running: bool, epoch: str | None, rows: tuple[str, ...]) -> str:
        """The statement of :meth:`create_batch` (``rows``: the parameters bound as arrays)."""
        c, jobs_t, wm = self._col, self._jobs, self._wm
        ns, entry, fire = c["namespace"], c["entry"], c["fire_time"]
        meta_epoch = f"(SELECT {c['epoch']} FROM {self._meta} WHERE {ns} = :k_ns)"
        ok = "SELECT 1 AS one"
        if epoch is not None:
            ok += f" WHERE {meta_epoch} = CAST(:epoch AS TEXT)"
        arrays = ", ".join(f"CAST(:a_{name} AS {_array_type(name)}[])" for name in rows)
        found = (
            f"(SELECT j.{c['id']} FROM {jobs_t} j WHERE j.{ns} = CAST(:k_ns AS TEXT)"
            f" AND j.{c['space']} = CAST(:k_space AS TEXT) AND j.{c['id']} = u.k_id)"
        )
        mark = (
            f"(SELECT m.{fire} FROM {wm} m WHERE m.{ns} = CAST(:k_ns AS TEXT)"
            f" AND m.{entry} = u.c_entry)"
        )
        # Each claim's values, read from the arrays (a colon escaped in the clock's SQL,
        # or inside a word, is no parameter).
        per_row = re.compile(r"(?<![\w\\]):(" + "|".join(rows) + r")\b")
        values = per_row.sub(r"v.\1", ", ".join(self._job_values_sql(running)))
        columns = ", ".join(c[name] for name in JOB_COLUMNS)
        return (
            f"{self._clock}, ok AS ({ok}),"
            f" v AS MATERIALIZED (SELECT u.*, {found} AS found_, {mark} AS mark_"
            f" FROM unnest({arrays}) WITH ORDINALITY AS u({', '.join(rows)}, i)),"
            f" wm AS (INSERT INTO {wm} ({ns}, {entry}, {fire})"
            f" SELECT CAST(:k_ns AS TEXT), v.c_entry, v.c_fire_time FROM v, ok"
            f" WHERE v.found_ IS NULL ORDER BY v.i"
            f" ON CONFLICT ({ns}, {entry}) DO UPDATE SET {fire} = EXCLUDED.{fire}"
            f" WHERE {wm}.{fire} IS NULL OR {wm}.{fire} < EXCLUDED.{fire}"
            f" RETURNING {entry} AS entry_),"
            f" ins AS (INSERT INTO {jobs_t} ({columns}) SELECT {values}"
            f" FROM clock, v JOIN wm ON wm.entry_ = v.c_entry ORDER BY v.i"
            f" RETURNING {c['id']} AS id_)"
            f" SELECT v.i, clock.now AS now_, {meta_epoch} AS stored_,"
            f" CASE WHEN ins.id_ IS NULL THEN 0 ELSE 1 END AS created_,"
            f" v.mark_, v.found_ AS id"
            f" FROM clock, v LEFT JOIN ins ON ins.id_ = v.k_id ORDER BY v.i"
        )


def _array_type(name: str) -> str:
    """The SQL type of a per-claim parameter's array (``c_<column>``: the column's)."""
    return "BIGINT" if name.startswith("c_") and name[2:] in _INTEGERS else "TEXT"


def _pipeline_supported() -> bool:
    try:
        import psycopg
    except ImportError:  # pragma: no cover - the psycopg dialect imported it
        return False
    return bool(psycopg.Pipeline.is_supported())
