# ruff: noqa: S608 - only quoted table and column names and fixed SQL are formatted into a
# statement here; every value is a bound parameter.
"""Batches in one round trip, on PostgreSQL: :class:`BatchStatements`.

**Claims.** A brief batch of beat's claims (``create_many`` of occurrences,
each of its own entry) is one statement, :meth:`BatchStatements.create_batch`:
the one-statement create of :mod:`~celery_exactonce.stores.sql.statements_base`
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

**Transitions.** A brief ``transition_many`` (beat's and the dispatcher's
``DISPATCHED`` and ``PUBLISHED`` writes of a chunk) is one statement,
:meth:`BatchStatements.transition_batch`: the one-row guarded ``UPDATE`` of
:mod:`~celery_exactonce.stores.sql.statements`, its per-job values (key,
guards, new ``rev``, history entry) bound as arrays and joined through
``unnest(...) WITH ORDINALITY``, its shared ones (target, node, lease...)
once. Each row is decided by the one-row statement's ``WHERE``, evaluated
on the row as its lock finds it (PostgreSQL rechecks a row a concurrent
writer changed): the compare-and-swap per row is the one-row statement's.
Only a batch of one shape (the same statement text), the same shared
values, one key space and no key twice is one statement; any other goes one
row at a time.

The rows are found by the primary key only: besides the join, the
statement names the keys as ``id = ANY(<array>)`` under the namespace and
the space, which only the primary key serves. A first version had the join
alone: PostgreSQL planned it from the namespace (a new namespace looks rare
to its statistics) and read every job of the namespace for each batch, 0.3 s
a batch of 32 with 10,000 jobs; a psycopg pipeline of one-row statements
came next, planned once per row.

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
from celery_exactonce.stores.sql.statements import Statements
from celery_exactonce.stores.sql.statements_base import _INTEGERS, JOB_COLUMNS

#: The integer parameters of a transition (those of a create are its integer columns').
_INTEGER_PARAMS = frozenset({"g_attempt", "g_stale", "s_run_at", "s_ret", "h_min", "h_full"})
#: The answers of :meth:`BatchStatements.create_batch`, one row per claim.
CREATE_ANSWERS = ("i", "now_", "stored_", "created_", "mark_", "id")


class BatchStatements(Statements):
    """:class:`Statements`, and batches of claims and of transitions as one statement each."""

    def transition_batch(
        self, namespace: str, items: Sequence[tuple[JobRef, Transition]]
    ) -> tuple[sa.TextClause | sa.TextualSelect, dict[str, Any]] | None:
        """One brief guarded ``UPDATE`` of every item; ``None`` when they are not one.

        Answers one row: ``applied``, the 1-based positions of the items it
        changed (``NULL``: none), so a store reads it as the first row of a
        statement run alone. ``None``: not PostgreSQL, fewer than two items,
        shapes or shared values that differ, key spaces that differ, a key twice.
        """
        if not self._pg or len(items) < 2:
            return None
        parts = [self._transition_parts(namespace, ref, t, brief=True) for ref, t in items]
        shape = parts[0][0]
        if any(other != shape for other, _ in parts[1:]):
            return None
        if len({ref.id for ref, _ in items}) != len(items):
            return None
        split = _split([params for _, params in parts], always=("k_id",))
        if split is None or "k_space" in split[0]:
            return None
        rows, bound = split
        key = ("transition_batch", shape, rows)
        return self._text(
            key, functools.partial(self._transition_batch_sql, shape, rows), ("applied",)
        ), bound

    def _by_key(self, rows: tuple[str, ...], column: str) -> tuple[str, str]:
        """A batch's per-row ``rows`` as arrays to ``unnest``, and the subquery that finds
        a row's job by its key (row ``u``), answering the job's ``column``."""
        c = self._col
        arrays = ", ".join(f"CAST(:a_{name} AS {_array_type(name)}[])" for name in rows)
        found = (
            f"(SELECT j.{column} FROM {self._jobs} j WHERE j.{c['namespace']} = CAST(:k_ns AS TEXT)"
            f" AND j.{c['space']} = CAST(:k_space AS TEXT) AND j.{c['id']} = u.k_id)"
        )
        return arrays, found

    def _transition_batch_sql(self, shape: tuple[Any, ...], rows: tuple[str, ...]) -> str:
        """The one-row statement of ``shape``, its per-job parameters read from the arrays,
        in a ``WITH`` whose one row aggregates the positions it changed."""
        sql = _per_row(rows).sub(r"v.\1", self._transition_sql(shape))
        jobs_t = self._jobs
        arrays, found = self._by_key(rows, "ctid")
        rows_cte = (
            f", v AS MATERIALIZED (SELECT u.*, {found} AS tid_"
            f" FROM unnest({arrays}) WITH ORDINALITY AS u({', '.join(rows)}, i))"
        )
        for old, new in (
            (self._with_clock, f"{self._clock}{rows_cte}, done AS ("),
            (" FROM clock WHERE ", " FROM clock, v WHERE "),
            (_per_row(rows).sub(r"v.\1", self._key_sql(jobs_t)), f"{jobs_t}.ctid = v.tid_"),
            (" RETURNING 1 AS one", " RETURNING v.i) SELECT array_agg(i) AS applied FROM done"),
        ):
            if sql.count(old) != 1:  # pragma: no cover - the one-row statement changed shape
                raise AssertionError(f"the transition statement has no single {old.strip()!r}")
            sql = sql.replace(old, new)
        return sql

    def decided(
        self, namespace: str, entries: Sequence[str], ids: Sequence[str]
    ) -> tuple[sa.TextClause | sa.TextualSelect, dict[str, Any]]:
        """PostgreSQL: the read of a batch of claims' decided slots, each row by its key.

        Rows of ``(kind, key, mark)``: ``m`` an entry and its watermark (when it
        has one), ``j`` the id of an occurrence record that exists, ``e`` the
        namespace's epoch. The same answers as the store's portable read
        (``IN`` lists), which PostgreSQL served by reading every job and mark
        of the namespace (the key columns' last one a filter, not a bound).
        """
        params: dict[str, Any] = {"k_ns": namespace, "k_space": Space.OCCURRENCE.value}
        params.update(a_entries=list(entries), a_ids=list(ids))

        def build() -> str:
            c = self._col
            ns, ns_param = c["namespace"], "CAST(:k_ns AS TEXT)"
            mark = (
                f"(SELECT m.{c['fire_time']} FROM {self._wm} m"
                f" WHERE m.{ns} = {ns_param} AND m.{c['entry']} = e.entry)"
            )
            found = (
                f"(SELECT j.{c['id']} FROM {self._jobs} j WHERE j.{ns} = {ns_param}"
                f" AND j.{c['space']} = CAST(:k_space AS TEXT) AND j.{c['id']} = k.id)"
            )
            return (
                f"WITH m AS MATERIALIZED (SELECT e.entry, {mark} AS mark"
                f" FROM unnest(CAST(:a_entries AS TEXT[])) AS e(entry)),"
                f" f AS MATERIALIZED (SELECT k.id, {found} AS found"
                f" FROM unnest(CAST(:a_ids AS TEXT[])) AS k(id))"
                f" SELECT 'm' AS kind, m.entry AS key, m.mark FROM m WHERE m.mark IS NOT NULL"
                f" UNION ALL SELECT 'j', f.id, CAST(NULL AS BIGINT) FROM f"
                f" WHERE f.found IS NOT NULL"
                f" UNION ALL SELECT 'e', {c['epoch']}, CAST(NULL AS BIGINT) FROM {self._meta}"
                f" WHERE {ns} = {ns_param}"
            )

        return self._text(("decided",), build, ("kind", "key", "mark")), params

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
        split = _split(parts, always=("k_id", "c_entry", "c_fire_time"))
        if split is None:
            return None  # (histories of one length: one shape)
        rows, bound = split
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
        arrays, found = self._by_key(rows, c["id"])
        mark = (
            f"(SELECT m.{fire} FROM {wm} m WHERE m.{ns} = CAST(:k_ns AS TEXT)"
            f" AND m.{entry} = u.c_entry)"
        )
        # Each claim's values, read from the arrays (a colon escaped in the clock's SQL,
        # or inside a word, is no parameter).
        values = _per_row(rows).sub(r"v.\1", ", ".join(self._job_values_sql(running)))
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


def _split(
    parts: Sequence[dict[str, Any]], always: tuple[str, ...]
) -> tuple[tuple[str, ...], dict[str, Any]] | None:
    """The names bound per row (``always``, and those whose values differ), and the bound
    values: each shared one once, each per-row one as ``a_<name>``, a list in row order.
    ``None`` when the rows do not bind the same names."""
    first = parts[0]
    if any(params.keys() != first.keys() for params in parts[1:]):
        return None
    rows = tuple(
        sorted(
            name
            for name in first
            if name in always or any(params[name] != first[name] for params in parts[1:])
        )
    )
    bound = {name: value for name, value in first.items() if name not in rows}
    bound.update((f"a_{name}", [params[name] for params in parts]) for name in rows)
    return rows, bound


def _per_row(rows: tuple[str, ...]) -> re.Pattern[str]:
    """The bound parameters of ``rows`` in a statement (a colon escaped in the clock's SQL,
    or inside a word, is no parameter), to be replaced by the columns of ``v``."""
    return re.compile(r"(?<![\w\\]):(" + "|".join(rows) + r")\b")


def _array_type(name: str) -> str:
    """The SQL type of a per-row parameter's array: ``BIGINT`` for the integer ones."""
    column = name[2:] if name.startswith("c_") else None
    return "BIGINT" if column in _INTEGERS or name in _INTEGER_PARAMS else "TEXT"
