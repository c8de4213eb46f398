# ruff: noqa: S608 - only quoted table and column names and fixed SQL are formatted into a
# statement here; every value is a bound parameter.
"""The SQL store's one-statement writes: create, transition and heartbeat as single statements.

:class:`~celery_exactonce.stores.sql.SqlStore` runs its hot operations as one
statement each, the store clock read inside it (a ``WITH`` of the clock on
PostgreSQL, whose ``clock_timestamp()`` moves within a statement; the clock
expression itself on MySQL/MariaDB and SQLite, whose clocks hold still for a
statement), the guards written into its ``WHERE``:

* **transition**: ``UPDATE … WHERE <key> AND <every guard>`` (the lease as an
  ``EXISTS`` on its row, locked shared as the row lock held the lease before),
  whose effects restate :func:`~celery_exactonce.jobs.apply_transition` in
  SQL, the history entry included (appended to the JSON text, the oldest
  dropped at :data:`~celery_exactonce.jobs.HISTORY_LIMIT`). One row changed:
  applied. None: the store decides again on the locked row, the way it always
  did (that also tells a conflict from a missing record or a lost lease).
* **create** (PostgreSQL, any job; MariaDB ≥ 10.5, jobs that are not
  occurrences): ``INSERT … SELECT`` whose ``WHERE`` checks the epoch; on
  PostgreSQL a data-modifying ``WITH`` first advances an occurrence's
  watermark (``INSERT … ON CONFLICT DO UPDATE … WHERE`` the mark is below the
  slot and no record exists), and the record is inserted only from the row
  that did; the statement answers what the caller needs to decide (the clock,
  the epoch, whether it inserted, the record or the mark as they were).
* **heartbeat**: one ``UPDATE``.

Every value is a bound parameter; table and column names come from the
validated prefix, quoted by the dialect. A history entry is JSON text that
SQL completes: :func:`_entry_parts` cuts the entry :mod:`celery_exactonce.jobs`
would write where the source state and the store time go.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from celery_exactonce import jobs, times
from celery_exactonce.jobs import HistoryEntry
from celery_exactonce.refs import JobRef
from celery_exactonce.states import TERMINAL, State
from celery_exactonce.stores import sql_schema
from celery_exactonce.writes import NewJob, Transition

#: How every history entry starts (``HistoryEntry.to_json`` puts ``from`` first,
#: and a string value never holds an unescaped quote): counting it counts entries.
ENTRY_MARK = '{"from":'

_SRC = "\x01src\x01"
_AT = "\x01at\x01"
"""Stand-ins cut out of an encoded entry (control characters: no node id or reason has them)."""

_COMMA, _CLOSE = "','", "']'"
"""SQL literals of the history's separator and end."""

_JOB_COLUMNS = (
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


def _entry_parts(entry: HistoryEntry, *, src: bool) -> tuple[str, ...]:
    """The JSON text of ``entry`` cut where SQL puts the store time (and the source state).

    With ``src``: ``(head, mid, tail)``, the entry being ``head || state || mid
    || now || tail``; else ``(head, tail)`` around the time, ``from`` as in ``entry``.
    """
    data = entry.to_json()
    data["at"] = _AT
    if src:
        data["from"] = _SRC
    text = _encode(data)
    head, _, rest = text.partition(_encode(_SRC)) if src else ("", "", text)
    mid, _, tail = rest.partition(_encode(_AT))
    return (f'{head}"', f'"{mid}', tail) if src else (mid, tail)


def stale_micros(seconds: float) -> int:
    """The fewest microseconds ``d`` with ``d / 1e6 >= seconds`` (``check_transition``'s test)."""
    k = math.ceil(seconds * 1_000_000)
    while (k - 1) / 1_000_000 >= seconds:
        k -= 1
    while k / 1_000_000 < seconds:
        k += 1
    return k


class Statements:
    """The one-statement writes of one store (dialect, tables), texts built once per shape."""

    def __init__(
        self, dialect: sa.Dialect, tables: sql_schema.Tables, now: str, retention: float
    ) -> None:
        self.name = dialect.name
        quote = dialect.identifier_preparer.quote
        self._jobs = quote(tables.jobs.name)
        self._wm = quote(tables.watermarks.name)
        self._leases = quote(tables.leases.name)
        self._meta = quote(tables.meta.name)
        self._col = {name: quote(name) for name in (*_JOB_COLUMNS, "epoch", "name", "token")}
        self._retention_us = int(retention * 1_000_000)  # as Job.expires_at adds it
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

    def _but_last(self, text: str) -> str:
        """``text`` without its last character (a history's closing ``]``)."""
        return f"substr({text}, 1, {self._length(text)} - 1)"

    def _but_first_entry(self, text: str) -> str:
        """A history without its first entry: ``[`` and the text from the second entry on."""
        if self.name == "mysql":
            return f"CONCAT('[', SUBSTRING({text}, LOCATE(:h_mark, {text}, 3)))"
        find = "strpos" if self._pg else "instr"
        return f"'[' || substr({text}, {find}(substr({text}, 3), :h_mark) + 2)"

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

    # -- transition ----------------------------------------------------------------------

    def transition(
        self, namespace: str, ref: JobRef, t: Transition, *, brief: bool
    ) -> tuple[sa.TextClause | sa.TextualSelect, dict[str, Any]]:
        """``UPDATE`` the record if every guard of ``t`` holds; one row changed means applied.

        PostgreSQL returns the record written (``RETURNING``) unless ``brief``.
        """
        expect = sorted(s.value for s in t.expect - TERMINAL)
        running, terminal = t.to is State.RUNNING, t.to in TERMINAL
        lease = t.lease
        head, mid, tail = _entry_parts(
            HistoryEntry(
                State.PENDING, t.to, times.UNIX_EPOCH, t.node, t.reason, t.new_rev, t.action
            ),
            src=True,
        )
        params: dict[str, Any] = {
            "k_ns": namespace,
            "k_space": ref.space.value,
            "k_id": ref.id,
            "s_to": t.to.value,
            "s_rev": t.new_rev,
            "s_node": t.node,
            "s_reason": t.reason,
            "e_head": head,
            "e_mid": mid,
            "e_tail": tail,
            "h_mark": ENTRY_MARK,
            "h_min": len(ENTRY_MARK),
            "h_full": len(ENTRY_MARK) * jobs.HISTORY_LIMIT,
            **{f"x{i}": state for i, state in enumerate(expect)},
        }
        guards = {
            "rev": t.rev,
            "attempt": t.attempt,
            "run_id": t.run_id,
            "task": t.task,
            "stale": None if t.stale_for is None else stale_micros(t.stale_for),
        }
        params.update((f"g_{name}", value) for name, value in guards.items() if value is not None)
        if running:
            params["s_run_id"] = t.new_run_id
        if t.run_at is not None:
            params["s_run_at"] = times.to_micros(t.run_at)
        if terminal:
            params["s_ret"] = self._retention_us
        if lease is not None:
            params.update(l_name=lease.name, l_token=lease.token)
        shape = (
            "transition",
            brief,
            len(expect),
            tuple(g for g, v in guards.items() if v is not None),
            lease is not None,
            t.next_attempt,
            running,
            t.run_at is not None,
            terminal,
            t.to is State.DISPATCHED,
        )
        answers = ("one",) if brief else _JOB_COLUMNS
        return self._text(
            shape, lambda: self._transition_sql(shape), answers if self._pg else ()
        ), params

    def _transition_sql(self, shape: tuple[Any, ...]) -> str:
        _, brief, n_expect, guards, lease, next_attempt, running, run_at, terminal, dispatched = (
            shape
        )
        c, now, cast = self._col, self._now, self._param
        history, state = c["history"], c["state"]
        without_marks = self._length(f"replace({history}, :h_mark, '')")
        entries = f"({self._length(history)} - {without_marks})"  # characters of the marks
        kept = (
            f"CASE WHEN {entries} >= :h_full THEN {self._but_last(self._but_first_entry(history))}"
            f" ELSE {self._but_last(history)} END"
        )
        entry = self._concat(
            cast("e_head", "history"),
            state,
            cast("e_mid", "history"),
            now,
            cast("e_tail", "history"),
        )
        # MySQL assigns left to right, later assignments seeing earlier ones: the history
        # (which reads the old state) goes first; the others read only their own column.
        sets = [f"{history} = {self._concat(kept, _COMMA, entry, _CLOSE)}"]
        sets += [f"{state} = :s_to", f"{c['rev']} = :s_rev"]
        if next_attempt:
            sets.append(f"{c['attempt']} = {c['attempt']} + 1")
        if running:
            sets.append(f"{c['run_id']} = :s_run_id")
        elif next_attempt:
            sets.append(f"{c['run_id']} = NULL")
        if run_at:
            sets.append(f"{c['run_at']} = {cast('s_run_at', 'run_at')}")
        elif next_attempt:
            sets.append(f"{c['run_at']} = NULL")
        sets.append(f"{c['touched_at']} = {now}")
        if running:
            sets.append(f"{c['heartbeat_at']} = {now}")
        if terminal:
            fire = c["fire_time"]
            sets.append(f"{c['terminal_at']} = {now}")
            sets.append(
                f"{c['expires_at']} = CASE WHEN {fire} IS NOT NULL AND {fire} > {now}"
                f" THEN {fire} ELSE {now} END + {cast('s_ret', 'expires_at')}"
            )
        else:
            sets += [f"{c['terminal_at']} = NULL", f"{c['expires_at']} = NULL"]
        if dispatched:
            sets.append(f"{c['dispatches']} = {c['dispatches']} + 1")
        sets += [f"{c['node']} = :s_node", f"{c['reason']} = :s_reason"]
        where = [self._key_sql(self._jobs)]
        expected = f"{state} IN ({', '.join(f':x{i}' for i in range(n_expect))})"
        # The key finds the row. PostgreSQL could serve ``namespace AND state`` from the
        # due or stale index instead, filtering every job in that state: a guard
        # wrapped in IS TRUE is no index condition, so only the primary key is.
        where.append(f"({expected}) IS TRUE" if self._pg else expected)
        columns = {"rev": "rev", "attempt": "attempt", "run_id": "run_id", "task": "task"}
        where += [f"{c[columns[g]]} = :g_{g}" for g in guards if g in columns]
        if "stale" in guards:
            where.append(f"{now} - {c['touched_at']} >= {cast('g_stale', 'touched_at')}")
        if lease:
            lock = {"postgresql": " FOR SHARE", "mysql": " LOCK IN SHARE MODE"}.get(self.name, "")
            leases = self._leases
            where.append(
                f"EXISTS (SELECT 1 FROM {leases} WHERE {leases}.{c['namespace']} = :k_ns"
                f" AND {leases}.{c['name']} = :l_name AND {leases}.{c['token']} = :l_token"
                f" AND {leases}.{c['expires_at']} > {now}{lock})"
            )
        # A history this statement can extend (else the store writes it as apply_transition does).
        where.append(f"{entries} BETWEEN :h_min AND :h_full")
        returning = ""
        if self._pg:
            record = ", ".join(f"{self._jobs}.{c[name]}" for name in _JOB_COLUMNS)
            returning = " RETURNING 1 AS one" if brief else f" RETURNING {record}"
        return (
            f"{self._with_clock}UPDATE {self._jobs} SET {', '.join(sets)}"
            f"{' FROM clock' if self._pg else ''} WHERE {' AND '.join(where)}{returning}"
        )

    def _key_sql(self, table: str) -> str:
        c = self._col
        return (
            f"{table}.{c['namespace']} = :k_ns AND {table}.{c['space']} = :k_space"
            f" AND {table}.{c['id']} = :k_id"
        )

    # -- heartbeat -----------------------------------------------------------------------

    def heartbeat(
        self, namespace: str, ref: JobRef, run_id: str
    ) -> tuple[sa.TextClause | sa.TextualSelect, dict[str, Any]]:
        """Touch a RUNNING job of ``run_id``: one row changed means it was touched."""
        params = {
            "k_ns": namespace,
            "k_space": ref.space.value,
            "k_id": ref.id,
            "g_state": State.RUNNING.value,
            "g_run_id": run_id,
        }

        def build() -> str:
            c, now = self._col, self._now
            running = f"{c['state']} = :g_state"
            return (
                f"{self._with_clock}UPDATE {self._jobs} SET {c['touched_at']} = {now},"
                f" {c['heartbeat_at']} = {now}{' FROM clock' if self._pg else ''}"
                f" WHERE {self._key_sql(self._jobs)}"
                f" AND {f'({running}) IS TRUE' if self._pg else running}"  # the key finds the row
                f" AND {c['run_id']} = :g_run_id"
            )

        return self._text(("heartbeat",), build), params

    # -- create --------------------------------------------------------------------------

    def _create_params(self, namespace: str, new: NewJob, epoch: str | None) -> dict[str, Any]:
        job = jobs.job_from_new(new, times.UNIX_EPOCH)
        values = sql_schema.job_values(job, namespace, 1.0, key=False)
        head, tail = _entry_parts(job.history[0], src=False)
        params = {f"c_{name}": value for name, value in values.items()}
        params.update(
            k_ns=namespace,
            k_space=new.ref.space.value,
            k_id=new.ref.id,
            h_head=f"[{head}",
            h_tail=f"{tail}]",
        )
        if epoch is not None:
            params["epoch"] = epoch
        return params

    def _job_values_sql(self, running: bool) -> list[str]:
        """The ``SELECT`` list that inserts a new record (``clock``/``now``: the store time)."""
        now, exprs = self._now, []
        for name in _JOB_COLUMNS:
            if name in ("namespace", "space", "id"):
                key = {"namespace": "k_ns", "space": "k_space", "id": "k_id"}[name]
                exprs.append(self._param(key, name))
            elif name in ("created_at", "touched_at") or (name == "heartbeat_at" and running):
                exprs.append(now)
            elif name == "history":
                exprs.append(
                    self._concat(self._param("h_head", name), now, self._param("h_tail", name))
                )
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
            columns = ", ".join(c[name] for name in _JOB_COLUMNS)
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
            columns = ", ".join(c[name] for name in _JOB_COLUMNS)
            values = ", ".join(self._job_values_sql(new.state is State.RUNNING))
            return (
                f"INSERT INTO {self._jobs} ({columns}) SELECT {values} FROM DUAL{where}"
                f" RETURNING {c['created_at']} AS now_, {meta_epoch} AS stored_"
            )

        return self._text(shape, build, ("now_", "stored_")), params
