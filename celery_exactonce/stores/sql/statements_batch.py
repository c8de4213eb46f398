"""A batch of transitions in one round trip, on PostgreSQL: :class:`BatchStatements`.

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

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from celery_exactonce.core import jobs
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.writes import Transition
from celery_exactonce.stores.sql import schema as sql_schema
from celery_exactonce.stores.sql.statements import Statements


class BatchStatements(Statements):
    """:class:`Statements`, and a brief batch of transitions as one pipeline (PostgreSQL)."""

    def __init__(
        self,
        dialect: sa.Dialect,
        tables: sql_schema.Tables,
        now: str,
        retention: float,
        *,
        compaction: jobs.Compaction = jobs.KEEP,
    ) -> None:
        super().__init__(dialect, tables, now, retention, compaction=compaction)
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


def _pipeline_supported() -> bool:
    try:
        import psycopg
    except ImportError:  # pragma: no cover - the psycopg dialect imported it
        return False
    return bool(psycopg.Pipeline.is_supported())
