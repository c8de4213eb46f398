"""The execution ledger: one SQLite row per task-body event, from any process.

Worker pool children append rows while the test process reads them. Every
write opens its own connection, takes the write lock up front
(``BEGIN IMMEDIATE``) and waits up to :data:`BUSY_TIMEOUT` seconds for it; the
database runs in WAL mode so readers never block writers.

Rows: ``task`` (registered name), ``task_id``, ``attempt``
(``self.request.retries``), ``phase`` (``run`` for a one-shot body, ``start`` /
``end`` around a slow body), ``args`` and ``kwargs`` (JSON), ``pid`` (the pool
child), ``at`` (``time.time()``), ``meta`` (JSON: what the request carried
besides its arguments, e.g. a beat occurrence's entry and fire time).
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from typing import Any

BUSY_TIMEOUT = 30.0

#: The phases that mark one execution of a body (``end`` closes a ``start``).
EXECUTION_PHASES = ("run", "start")

SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    task TEXT NOT NULL,
    task_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    phase TEXT NOT NULL,
    args TEXT NOT NULL,
    kwargs TEXT NOT NULL,
    pid INTEGER NOT NULL,
    at REAL NOT NULL,
    meta TEXT NOT NULL DEFAULT '{}'
)
"""


def connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT, isolation_level=None)
    conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT * 1000)}")
    return conn


def create(path: str) -> None:
    """Create the ledger file (WAL mode, the table); safe to call again."""
    conn = connect(path)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute(SCHEMA)
    finally:
        conn.close()


def append(
    path: str,
    *,
    task: str,
    task_id: str,
    attempt: int,
    phase: str,
    args: Any = (),
    kwargs: Any = None,
    meta: Any = None,
) -> None:
    """Append one row, durably, before returning."""
    conn = connect(path)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(SCHEMA)
        conn.execute(
            "INSERT INTO ledger (task, task_id, attempt, phase, args, kwargs, pid, at, meta)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                task,
                task_id,
                int(attempt),
                phase,
                json.dumps(list(args), default=repr),
                json.dumps(kwargs or {}, default=repr, sort_keys=True),
                os.getpid(),
                time.time(),
                json.dumps(meta or {}, default=repr, sort_keys=True),
            ),
        )
        conn.execute("COMMIT")
    finally:
        conn.close()
