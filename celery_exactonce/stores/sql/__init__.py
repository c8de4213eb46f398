"""The SQL store: :class:`SqlStore` (PostgreSQL, MySQL/MariaDB, SQLite), split by concern.

``store`` keeps every operation of the contract, on ``base`` (one transaction
per operation, driver errors, fork safety) and ``shared`` (a transaction the
caller holds across operations); ``engine`` holds what differs per dialect;
``creates``, ``transitions``, ``leases`` and ``scans`` decide each kind of
operation inside its transaction; ``statements`` builds the one-statement
writes (the creates, and the SQL spelt per dialect, in ``statements_base``);
``schema`` holds the tables.
"""

from __future__ import annotations

from celery_exactonce.stores.sql.store import SqlStore

__all__ = ["SqlStore"]
