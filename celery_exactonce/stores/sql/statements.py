# ruff: noqa: S608 - only quoted table and column names and fixed SQL are formatted into a
# statement here; every value is a bound parameter.
"""The SQL store's one-statement writes: :class:`Statements`, and its transition and heartbeat.

:class:`~celery_exactonce.stores.sql.store.SqlStore` runs its hot operations as one
statement each, the store clock read inside it, the guards written into its
``WHERE``. :class:`Statements` is what the store builds, one per store; its
``UPDATE`` statements are here:

* **transition**: ``UPDATE … WHERE <key> AND <every guard>`` (the lease as an
  ``EXISTS`` on its row, locked shared as the row lock held the lease before),
  whose effects restate :func:`~celery_exactonce.core.jobs.apply_transition` in
  SQL, the history entry included (appended to the JSON text, the oldest
  dropped at :data:`~celery_exactonce.core.jobs.HISTORY_LIMIT`). One row changed:
  applied. None: the store decides again on the locked row, the way it always
  did (that also tells a conflict from a missing record or a lost lease).
* **heartbeat**: one ``UPDATE``.

It is made of, one module each:

* :mod:`~celery_exactonce.stores.sql.statements_base`: the SQL spelt per
  dialect (names, clock, typed parameters, a record's key, the history entry
  cut for SQL to complete) and the texts built once per shape; and the
  create, an ``INSERT … SELECT`` checking the epoch (on PostgreSQL advancing
  an occurrence's watermark in the same statement).

Not here: deciding what a statement that changed nothing means (the locking
way: :mod:`~celery_exactonce.stores.sql.transitions`,
:mod:`~celery_exactonce.stores.sql.creates`), the tables
(:mod:`~celery_exactonce.stores.sql.schema`).
"""

from __future__ import annotations

import math
from typing import Any

import sqlalchemy as sa

from celery_exactonce.core import jobs, times
from celery_exactonce.core.jobs import HistoryEntry
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import TERMINAL, State
from celery_exactonce.core.writes import Transition
from celery_exactonce.stores.sql.rows import COMPACT_PAYLOAD
from celery_exactonce.stores.sql.statements_base import (
    JOB_COLUMNS,
    CreateStatements,
    entry_parts,
)

#: How every history entry starts (``HistoryEntry.to_json`` puts ``from`` first,
#: and a string value never holds an unescaped quote): counting it counts entries.
ENTRY_MARK = '{"from":'

_COMMA, _CLOSE, _EMPTY = "','", "']'", "'[]'"
"""SQL literals of the history's separator and end."""


def stale_micros(seconds: float) -> int:
    """The fewest microseconds ``d`` with ``d / 1e6 >= seconds`` (``check_transition``'s test)."""
    k = math.ceil(seconds * 1_000_000)
    while (k - 1) / 1_000_000 >= seconds:
        k -= 1
    while k / 1_000_000 < seconds:
        k += 1
    return k


class Statements(CreateStatements):
    """The one-statement writes of one store (dialect, tables), texts built once per shape."""

    # -- SQL spelt for a history ---------------------------------------------------------

    def _but_last(self, text: str) -> str:
        """``text`` without its last character (a history's closing ``]``)."""
        return f"substr({text}, 1, {self._length(text)} - 1)"

    def _but_first_entry(self, text: str) -> str:
        """A history without its first entry: ``[`` and the text from the second entry on."""
        if self.name == "mysql":
            return f"CONCAT('[', SUBSTRING({text}, LOCATE(:h_mark, {text}, 3)))"
        find = "strpos" if self._pg else "instr"
        return f"'[' || substr({text}, {find}(substr({text}, 3), :h_mark) + 2)"

    # -- transition ----------------------------------------------------------------------

    def transition(
        self, namespace: str, ref: JobRef, t: Transition, *, brief: bool
    ) -> tuple[sa.TextClause | sa.TextualSelect, dict[str, Any]]:
        """``UPDATE`` the record if every guard of ``t`` holds; one row changed means applied.

        PostgreSQL returns the record written (``RETURNING``) unless ``brief``.
        """
        shape, params = self._transition_parts(namespace, ref, t, brief=brief)
        answers = ("one",) if brief else JOB_COLUMNS
        return self._text(
            shape, lambda: self._transition_sql(shape), answers if self._pg else ()
        ), params

    def _transition_parts(
        self, namespace: str, ref: JobRef, t: Transition, *, brief: bool
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The shape of ``t``'s statement (what its text depends on), and its parameters."""
        expect = sorted(s.value for s in t.expect - TERMINAL)
        running, terminal = t.to is State.RUNNING, t.to in TERMINAL
        lease = t.lease
        head, mid, tail = entry_parts(
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
            retention = self._compaction.retention_of(ref, self._retention)
            params["s_ret"] = int(retention * 1_000_000)  # as Job.expires_at adds it
            if not self._compaction.payload:
                params["s_payload"] = COMPACT_PAYLOAD
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
        return shape, params

    def _transition_sql(self, shape: tuple[Any, ...]) -> str:
        _, brief, n_expect, guards, lease, next_attempt, running, run_at, terminal, dispatched = (
            shape
        )
        c, now, cast = self._col, self._now, self._param
        history, state = c["history"], c["state"]
        # The marks' length: each is ASCII, so bytes count them as characters would.
        without_marks = self._octets(f"replace({history}, :h_mark, '')")
        entries = f"({self._octets(history)} - {without_marks})"
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
        sets = self._history_sets(kept, entry, terminal)
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
            record = ", ".join(f"{self._jobs}.{c[name]}" for name in JOB_COLUMNS)
            returning = " RETURNING 1 AS one" if brief else f" RETURNING {record}"
        return (
            f"{self._with_clock}UPDATE {self._jobs} SET {', '.join(sets)}"
            f"{' FROM clock' if self._pg else ''} WHERE {' AND '.join(where)}{returning}"
        )

    def _history_sets(self, kept: str, entry: str, terminal: bool) -> list[str]:
        """The history's assignment, and the payload's on a compacted terminal record.

        ``kept``: the history's text without its end (and its oldest entry when full);
        ``entry``: the new entry's. A terminal record keeps what
        :func:`~celery_exactonce.core.jobs.compact_terminal` keeps.
        """
        c, keep = self._col, self._compaction
        history = self._concat(kept, _COMMA, entry, _CLOSE)
        if terminal and keep.history != "full":
            history = self._concat("'['", entry, _CLOSE) if keep.history == "last" else _EMPTY
        sets = [f"{c['history']} = {history}"]
        if terminal and not keep.payload:
            sets.append(f"{c['payload']} = :s_payload")
        return sets

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
