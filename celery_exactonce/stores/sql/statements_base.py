# ruff: noqa: S608 - only quoted table and column names and fixed SQL are formatted into a
# statement here; every value is a bound parameter.
"""What every one-statement write of the SQL store is built from, and the one-statement creates.

:class:`StatementCore` is the base of
:class:`~celery_exactonce.stores.sql.statements.Statements`. It holds what one
store's dialect and tables fix: the quoted table and column names, the store
clock read inside the statement (a ``WITH`` of the clock on PostgreSQL, whose
``clock_timestamp()`` moves within a statement; the clock expression itself
on MySQL/MariaDB and SQLite, whose clocks hold still for a statement), the SQL
that differs per dialect (concatenation, length, a bound value typed on
PostgreSQL), a record's key, and each statement's text, built once per shape.

Every value is a bound parameter; table and column names come from the
validated prefix, quoted by the dialect. :data:`JOB_COLUMNS` are a record's
columns in the order the statements write and answer them. A history entry
is JSON text that SQL completes: :func:`entry_parts` cuts the entry
:mod:`celery_exactonce.core.jobs` would write where the source state and the store
time go.

On it, :class:`CreateStatements` builds a create as one statement where the database
allows it (PostgreSQL, any job; MariaDB ≥ 10.5, jobs that are not
occurrences): ``INSERT … SELECT`` whose ``WHERE`` checks the epoch. On
PostgreSQL a data-modifying ``WITH`` first advances an occurrence's watermark
(``INSERT … ON CONFLICT DO UPDATE … WHERE`` the mark is below the slot and no
record exists), and the record is inserted only from the row that did; the
statement answers what the caller needs to decide (the clock, the epoch,
whether it inserted, the record or the mark as they were). The record's
values are those :func:`~celery_exactonce.stores.sql.rows.job_values`
writes; its times and its first history entry take the store time in SQL.

Not here: the other statements (the transition and the heartbeat in
:mod:`~celery_exactonce.stores.sql.statements`), deciding a create, and the
locking way for what one statement cannot decide
(:mod:`~celery_exactonce.stores.sql.creates`), the tables
(:mod:`~celery_exactonce.stores.sql.schema`), running them
(:mod:`~celery_exactonce.stores.sql.base`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa

from celery_exactonce.core import jobs, times
from celery_exactonce.core.jobs import HistoryEntry, Job
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.stores.sql import rows as sql_rows
from celery_exactonce.stores.sql import schema as sql_schema

_SRC = "\x01src\x01"
_AT = "\x01at\x01"
"""Stand-ins cut out of an encoded entry (control characters: no node id or reason has them)."""

#: A record's columns, in the order the statements write and answer them.
JOB_COLUMNS = (
    "namespace",
    "space",
    "id",
    "task",
    "state",
    "rev",
    "attempt",
    "run_id",
    "payload",
    "entry",
    "fire_time",
    "run_at",
    "deadline",
    "created_at",
    "touched_at",
    "heartbeat_at",
    "terminal_at",
    "expires_at",
    "dispatches",
    "node",
    "reason",
    "history",
)
#: The columns whose bound values PostgreSQL takes as ``BIGINT`` (:meth:`StatementCore._param`).
_INTEGERS = frozenset(
    {
        "attempt",
        "fire_time",
        "run_at",
        "deadline",
        "created_at",
        "touched_at",
        "heartbeat_at",
        "terminal_at",
        "expires_at",
        "dispatches",
    }
)


def _encode(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))  # as sql_schema.job_values writes history


#: The placeholders as :func:`_encode` writes them (what the encoded texts are cut at).
_SRC_TEXT, _AT_TEXT = _encode(_SRC), _encode(_AT)


def entry_parts(entry: HistoryEntry, *, src: bool) -> tuple[str, ...]:
    """The JSON text of ``entry`` cut where SQL puts the store time (and the source state).

    With ``src``: ``(head, mid, tail)``, the entry being ``head || state || mid
    || now || tail``; else ``(head, tail)`` around the time, ``from`` as in ``entry``.
    """
    data = entry.to_json()
    data["at"] = _AT
    if src:
        data["from"] = _SRC
    text = _encode(data)
    head, _, rest = text.partition(_SRC_TEXT) if src else ("", "", text)
    mid, _, tail = rest.partition(_AT_TEXT)
    return (f'{head}"', f'"{mid}', tail) if src else (mid, tail)


def history_parts(history: Sequence[HistoryEntry]) -> list[str]:
    """The JSON text of ``history`` cut where SQL puts each entry's store time."""
    text = _encode([{**entry.to_json(), "at": _AT} for entry in history])
    return text.split(_AT_TEXT)


class StatementCore:
    """What the one-statement writes of one store (dialect, tables) are spelt with."""

    def __init__(
        self,
        dialect: sa.Dialect,
        tables: sql_schema.Tables,
        now: str,
        retention: float,
        *,
        compaction: jobs.Compaction = jobs.KEEP,
    ) -> None:
        self.name = dialect.name
        self._compaction = compaction  # what a terminal record keeps
        quote = dialect.identifier_preparer.quote
        self._jobs = quote(tables.jobs.name)
        self._wm = quote(tables.watermarks.name)
        self._leases = quote(tables.leases.name)
        self._meta = quote(tables.meta.name)
        self._col = {name: quote(name) for name in (*JOB_COLUMNS, "epoch", "name", "token")}
        self._retention_us = int(retention * 1_000_000)  # as Job.expires_at adds it
        self._retention = retention
        # A colon in the clock's SQL ('00:00:00') must not read as a bound parameter.
        now = now.replace(":", "\\:")
        self._pg = self.name == "postgresql"
        self._clock = f"WITH clock AS (SELECT {now} AS now)"
        self._now = "clock.now" if self._pg else f"({now})"
        self._with_clock = f"{self._clock} " if self._pg else ""
        self._cache: dict[tuple[Any, ...], sa.TextClause | sa.TextualSelect] = {}

    # -- SQL spelt per dialect -----------------------------------------------------------

    def _concat(self, *parts: str) -> str:
        return f"CONCAT({', '.join(parts)})" if self.name == "mysql" else " || ".join(parts)

    def _length(self, text: str) -> str:
        return f"CHAR_LENGTH({text})" if self.name == "mysql" else f"length({text})"

    def _octets(self, text: str) -> str:
        """``text``'s length in bytes where the database keeps it (no scan of a UTF-8
        text for its characters); SQLite counts characters."""
        return {"postgresql": f"octet_length({text})", "mysql": f"LENGTH({text})"}.get(
            self.name, f"length({text})"
        )

    def _param(self, name: str, column: str) -> str:
        """A bound value for ``column`` (typed on PostgreSQL, where ``SELECT $1`` is text)."""
        if not self._pg:
            return f":{name}"
        return f"CAST(:{name} AS {'BIGINT' if column in _INTEGERS else 'TEXT'})"

    def _text(
        self, key: tuple[Any, ...], build: Callable[[], str], columns: tuple[str, ...] = ()
    ) -> sa.TextClause | sa.TextualSelect:
        """The statement of ``key``, built once; ``columns``: those it answers, in order.

        Naming them lets SQLAlchemy keep the result's metadata with the
        compiled statement instead of rebuilding it from every cursor.
        """
        stmt = self._cache.get(key)
        if stmt is None:
            stmt = sa.text(build())
            if columns:
                stmt = stmt.columns(*(sa.column(name) for name in columns))
            self._cache[key] = stmt
        return stmt

    def _key_sql(self, table: str) -> str:
        c = self._col
        return (
            f"{table}.{c['namespace']} = :k_ns AND {table}.{c['space']} = :k_space"
            f" AND {table}.{c['id']} = :k_id"
        )


class CreateStatements(StatementCore):
    """The one-statement creates of one store (see the module docs)."""

    def _create_params(self, namespace: str, new: NewJob, epoch: str | None) -> dict[str, Any]:
        job = jobs.job_from_new(new, times.UNIX_EPOCH)
        params = self._record_params(namespace, job, sql_rows.new_payload(new))
        if epoch is not None:
            params["epoch"] = epoch
        return params

    def _record_params(
        self, namespace: str, job: Job, payload: str | None = None
    ) -> dict[str, Any]:
        """The bound values inserting ``job`` (its times aside: SQL writes the store time).

        The history is JSON text cut where each entry's time goes: ``h_0``,
        ``h_1``... around them (:meth:`_job_values_sql`). ``payload``: the payload
        column's text, where its request kept it encoded.
        """
        values = sql_rows.job_values(job, namespace, 1.0, key=False, payload=payload, history=False)
        params = {f"c_{name}": value for name, value in values.items()}
        params.update(k_ns=namespace, k_space=job.ref.space.value, k_id=job.ref.id)
        for i, piece in enumerate(history_parts(job.history)):
            params[f"h_{i}"] = piece
        return params

    def _job_values_sql(self, running: bool, entries: int = 1) -> list[str]:
        """The ``SELECT`` list that inserts a new record (``clock``/``now``: the store time).

        ``entries``: how many entries its history has, each stamped with the store time.
        """
        now, exprs = self._now, []
        for name in JOB_COLUMNS:
            if name in ("namespace", "space", "id"):
                key = {"namespace": "k_ns", "space": "k_space", "id": "k_id"}[name]
                exprs.append(self._param(key, name))
            elif name in ("created_at", "touched_at") or (name == "heartbeat_at" and running):
                exprs.append(now)
            elif name == "history":
                parts = [self._param("h_0", name)]
                for i in range(1, entries + 1):
                    parts += [now, self._param(f"h_{i}", name)]
                exprs.append(self._concat(*parts))
            else:
                exprs.append(self._param(f"c_{name}", name))
        return exprs

    def create_postgresql(
        self, namespace: str, new: NewJob, epoch: str | None
    ) -> tuple[sa.TextClause | sa.TextualSelect, dict[str, Any]]:
        """One statement: check the epoch, advance an occurrence's mark, insert the record.

        Answers one row: ``now_``, ``stored_`` (the epoch), ``created_`` (rows
        inserted), ``mark_`` (an occurrence's watermark before the statement)
        and ``id``, the record's as it was before the statement (``NULL``: none).
        """
        occurrence = new.entry is not None
        params = self._create_params(namespace, new, epoch)
        shape = ("create", occurrence, new.state is State.RUNNING, epoch is not None)
        answers = ("now_", "stored_", "created_", *(("mark_",) if occurrence else ()), "id")

        def build() -> str:
            c, jobs_t, wm = self._col, self._jobs, self._wm
            meta_epoch = f"(SELECT {c['epoch']} FROM {self._meta} WHERE {c['namespace']} = :k_ns)"
            ok = "SELECT 1 AS one"
            if epoch is not None:
                ok += f" WHERE {meta_epoch} = CAST(:epoch AS TEXT)"
            parts = [self._clock, f"ok AS ({ok})"]
            source = "ok"
            if occurrence:
                fire, entry = c["fire_time"], c["entry"]
                parts.append(
                    f"wm AS (INSERT INTO {wm} ({c['namespace']}, {entry}, {fire})"
                    f" SELECT CAST(:k_ns AS TEXT), CAST(:c_entry AS TEXT),"
                    f" CAST(:c_fire_time AS BIGINT) FROM ok"
                    f" ON CONFLICT ({c['namespace']}, {entry})"
                    f" DO UPDATE SET {fire} = EXCLUDED.{fire}"
                    f" WHERE ({wm}.{fire} IS NULL OR {wm}.{fire} < EXCLUDED.{fire})"
                    f" AND NOT EXISTS (SELECT 1 FROM {jobs_t} WHERE {self._key_sql(jobs_t)})"
                    f" RETURNING 1 AS one)"
                )
                source = "wm"
            # An occurrence's insert has no ON CONFLICT: its record exists only if another
            # entry's create made it (the mark serialises one entry's), and the statement fails.
            on_conflict = "" if occurrence else " ON CONFLICT DO NOTHING"
            columns = ", ".join(c[name] for name in JOB_COLUMNS)
            values = ", ".join(self._job_values_sql(new.state is State.RUNNING))
            parts.append(
                f"ins AS (INSERT INTO {jobs_t} ({columns}) SELECT {values} FROM clock, {source}"
                f"{on_conflict} RETURNING 1 AS one)"
            )
            mark = ""
            if occurrence:
                mark = (
                    f", (SELECT {c['fire_time']} FROM {wm} WHERE {c['namespace']} = :k_ns"
                    f" AND {c['entry']} = :c_entry) AS mark_"
                )
            return (
                f"{', '.join(parts)} SELECT clock.now AS now_, {meta_epoch} AS stored_,"
                f" (SELECT count(*) FROM ins) AS created_{mark}, j.{c['id']} AS id"
                f" FROM clock LEFT JOIN {jobs_t} j ON {self._key_sql('j')}"
            )

        return self._text(shape, build, answers), params

    def create_returning(
        self, namespace: str, new: NewJob, epoch: str | None
    ) -> tuple[sa.TextClause | sa.TextualSelect, dict[str, Any]]:
        """MariaDB: ``INSERT … SELECT`` checking the epoch, ``RETURNING`` the time and the epoch.

        For a job that is not an occurrence. No row: the epoch differs. A
        duplicate-key error: the record exists.
        """
        params = self._create_params(namespace, new, epoch)
        shape = ("create_returning", new.state is State.RUNNING, epoch is not None)

        def build() -> str:
            c = self._col
            meta_epoch = f"(SELECT {c['epoch']} FROM {self._meta} WHERE {c['namespace']} = :k_ns)"
            where = f" WHERE {meta_epoch} = :epoch" if epoch is not None else ""
            columns = ", ".join(c[name] for name in JOB_COLUMNS)
            values = ", ".join(self._job_values_sql(new.state is State.RUNNING))
            return (
                f"INSERT INTO {self._jobs} ({columns}) SELECT {values} FROM DUAL{where}"
                f" RETURNING {c['created_at']} AS now_, {meta_epoch} AS stored_"
            )

        return self._text(shape, build, ("now_", "stored_")), params

    def enqueue(
        self, namespace: str, new: NewJob, dispatch: Transition, *, returning: bool
    ) -> tuple[sa.TextClause | sa.TextualSelect, dict[str, Any]]:
        """One ``INSERT``: ``new`` created with ``dispatch`` applied, unless its key exists.

        For a job that is not an occurrence, created ``SCHEDULED``: the record
        is written ``DISPATCHED`` under ``dispatch.new_rev``, both entries in its
        history, every time the store time of the statement. No epoch and no
        read: with ``returning`` (PostgreSQL, SQLite, MariaDB ≥ 10.5) the
        statement answers one row, ``now_``, the store time it wrote, and none
        when the key exists (PostgreSQL, SQLite: ``ON CONFLICT DO NOTHING``);
        MySQL and MariaDB refuse the duplicate key with an error.
        """
        job = jobs.enqueued_job(new, dispatch, times.UNIX_EPOCH)
        params = self._record_params(namespace, job, sql_rows.new_payload(new))

        def build() -> str:
            c = self._col
            columns = ", ".join(c[name] for name in JOB_COLUMNS)
            values = ", ".join(self._job_values_sql(False, entries=len(job.history)))
            # (SQLite parses ``ON CONFLICT`` after a ``SELECT`` only once it has a ``WHERE``.)
            source = {"postgresql": " FROM clock", "sqlite": " WHERE true"}.get(
                self.name, " FROM DUAL"
            )
            on_conflict = "" if self.name == "mysql" else " ON CONFLICT DO NOTHING"
            answer = f" RETURNING {c['created_at']} AS now_" if returning else ""
            return (
                f"{self._with_clock}INSERT INTO {self._jobs} ({columns}) SELECT {values}{source}"
                f"{on_conflict}{answer}"
            )

        shape = ("enqueue", len(job.history), returning)
        return self._text(shape, build, ("now_",) if returning else ()), params
