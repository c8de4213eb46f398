"""What every one-statement write of the SQL store is built from: its SQL, spelt per dialect.

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

Not here: the statements themselves (the transition and the heartbeat in
:mod:`~celery_exactonce.stores.sql.statements`, the create in
:mod:`~celery_exactonce.stores.sql.statements_create`), the tables
(:mod:`~celery_exactonce.stores.sql.schema`), running them
(:mod:`~celery_exactonce.stores.sql.base`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa

from celery_exactonce.core import jobs
from celery_exactonce.core.jobs import HistoryEntry
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
