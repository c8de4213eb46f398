"""A batch of transitions as one statement, on PostgreSQL: :class:`BatchStatements`.

A brief ``transition_many`` (beat's and the dispatcher's ``DISPATCHED`` and
``PUBLISHED`` writes of a chunk) would otherwise send one guarded ``UPDATE``
per job. On PostgreSQL the batch is the same guarded ``UPDATE`` of
:mod:`~celery_exactonce.stores.sql.statements` run once for every row: the
values that differ per job (its key, the guards' values, the new ``rev``, the
history entry) are bound as arrays, one element per job, and joined to the
table through ``unnest(...) WITH ORDINALITY``; the rest (the target state,
the node, the lease...) is bound once. ``RETURNING`` names the jobs it
changed. Each row is decided by the same ``WHERE`` as its one-row
statement, evaluated on the row as the row lock finds it (PostgreSQL
rechecks a row a concurrent writer changed): the compare-and-swap per row
is the one-row statement's.

Only a batch whose transitions share one shape (the same statement text:
the same guards, target, lease...), the same shared values and no key twice
is one statement; any other goes one row at a time. The rows are bound in
key order, the order every batch locks its rows in.

Not here: what a row the statement did not change means (the store decides
it again the locking way, :mod:`~celery_exactonce.stores.sql.transitions`),
the one-row statement (:mod:`~celery_exactonce.stores.sql.statements`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.writes import Transition
from celery_exactonce.stores.sql.statements import Statements

#: The parameters of the one-row statement that differ per job: bound as arrays.
_ROW_PARAMS = frozenset(
    {
        "k_space",
        "k_id",
        "s_rev",
        "e_head",
        "e_mid",
        "e_tail",
        "g_rev",
        "g_attempt",
        "g_run_id",
        "g_task",
        "g_stale",
        "s_run_id",
        "s_run_at",
    }
)
#: Those of them that are integers (the others are text).
_INTEGER_PARAMS = frozenset({"g_attempt", "g_stale", "s_run_at"})
#: The expected states, ``x0``, ``x1``...: per job too (one shape, the same count).
_EXPECTED = re.compile(r"x\d+")


class BatchStatements(Statements):
    """:class:`Statements`, and a brief batch of transitions as one statement (PostgreSQL)."""

    def transition_batch(
        self, namespace: str, items: Sequence[tuple[JobRef, Transition]]
    ) -> tuple[sa.TextClause | sa.TextualSelect, dict[str, Any]] | None:
        """One brief guarded ``UPDATE`` of every item, in the order given; ``None``: not one.

        The statement answers the 1-based position (``i``) of each item it
        changed. ``None`` when the items cannot be one statement: not
        PostgreSQL, fewer than two, shapes or shared values that differ, a
        key twice.
        """
        if not self._pg or len(items) < 2:
            return None
        parts = [self._transition_parts(namespace, ref, t, brief=True) for ref, t in items]
        shape, first = parts[0]
        names = first.keys()
        rows = tuple(sorted(n for n in names if n in _ROW_PARAMS or _EXPECTED.fullmatch(n)))
        shared = [n for n in names if n not in rows]
        for other_shape, params in parts[1:]:
            if (
                other_shape != shape
                or params.keys() != names
                or any(params[n] != first[n] for n in shared)
            ):
                return None
        if len({(p["k_space"], p["k_id"]) for _, p in parts}) != len(parts):
            return None
        bound = {n: first[n] for n in shared}
        bound.update((f"a_{n}", [params[n] for _, params in parts]) for n in rows)
        return self._text(
            ("transition_batch", shape, rows), lambda: self._batch_sql(shape, rows), ("i",)
        ), bound

    def _batch_sql(self, shape: tuple[Any, ...], rows: tuple[str, ...]) -> str:
        """The one-row statement of ``shape``, its per-job parameters read from the arrays."""
        sql = self._transition_sql(shape)
        # The per-job parameters become the columns of ``v`` (a colon escaped in the
        # clock's SQL, or inside a word, is no parameter).
        per_job = re.compile(r"(?<![\w\\]):(" + "|".join(rows) + r")\b")
        sql = per_job.sub(r"v.\1", sql)
        arrays = ", ".join(
            f"CAST(:a_{n} AS {'BIGINT' if n in _INTEGER_PARAMS else 'TEXT'}[])" for n in rows
        )
        source = f" FROM clock, unnest({arrays}) WITH ORDINALITY AS v({', '.join(rows)}, i) WHERE "
        for old, new in ((" FROM clock WHERE ", source), (" RETURNING 1 AS one", " RETURNING v.i")):
            if sql.count(old) != 1:  # pragma: no cover - the one-row statement changed shape
                raise AssertionError(f"the transition statement has no single {old.strip()!r}")
            sql = sql.replace(old, new)
        return sql
