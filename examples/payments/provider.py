"""A tiny payment provider: charges in a SQLite table, once per idempotency key.

``charges`` has a UNIQUE index on ``idempotency_key``: a charge sent again
with a key the provider has seen is not made again (``INSERT ... ON CONFLICT
DO NOTHING``), as a real provider's idempotency keys do. ``calls`` keeps
every call it received, charged or not, so you can see the second attempts
that were refused.

The file is ``PAYMENTS_DB`` (default ``provider.sqlite3`` beside this file).
"""

from __future__ import annotations

import os
import sqlite3
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent

SCHEMA = """
CREATE TABLE IF NOT EXISTS charges (
    id INTEGER PRIMARY KEY,
    idempotency_key TEXT NOT NULL UNIQUE,
    order_id TEXT NOT NULL,
    cents INTEGER NOT NULL,
    charged_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS calls (
    id INTEGER PRIMARY KEY,
    idempotency_key TEXT NOT NULL,
    order_id TEXT NOT NULL,
    charged INTEGER NOT NULL,
    pid INTEGER NOT NULL,
    at TEXT NOT NULL
);
"""


def path() -> str:
    return os.environ.get("PAYMENTS_DB") or str(HERE / "provider.sqlite3")


def connect() -> sqlite3.Connection:
    """The provider's database, its tables made if missing (several processes write it)."""
    conn = sqlite3.connect(path(), timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")  # the report reads while workers write
    conn.executescript(SCHEMA)
    return conn


def charge(order_id: str, cents: int, *, idempotency_key: str) -> bool:
    """Charge ``cents`` for ``order_id`` once per ``idempotency_key``; whether it charged now."""
    now = datetime.now(timezone.utc).isoformat()
    conn = connect()
    try:
        with conn:  # one transaction: the charge (or not) and the call that asked for it
            inserted = conn.execute(
                "INSERT INTO charges (idempotency_key, order_id, cents, charged_at)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (idempotency_key) DO NOTHING",
                (idempotency_key, order_id, cents, now),
            )
            charged = inserted.rowcount == 1
            conn.execute(
                "INSERT INTO calls (idempotency_key, order_id, charged, pid, at)"
                " VALUES (?, ?, ?, ?, ?)",
                (idempotency_key, order_id, int(charged), os.getpid(), now),
            )
    finally:
        conn.close()
    return charged
