"""Django's connection of an alias as a SQLAlchemy engine, which Django keeps owning.

The store's statements are SQLAlchemy Core, compiled for the database's
dialect; :func:`engine_for` runs them on the very DB-API connection Django
holds for the calling thread, so they take part in Django's transactions.
SQLAlchemy borrows it: it never commits, rolls back or closes it.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from celery_exactonce.core import exceptions

#: The SQLAlchemy URL of each Django database vendor, by the DB-API module Django uses.
_DRIVERS = {
    ("postgresql", "psycopg"): "postgresql+psycopg://",
    ("postgresql", "psycopg2"): "postgresql+psycopg2://",
    ("sqlite", "sqlite3"): "sqlite+pysqlite://",
    ("mysql", "MySQLdb"): "mysql+mysqldb://",
    # PyMySQL standing in for mysqlclient (``pymysql.install_as_MySQLdb()`` in settings).
    ("mysql", "pymysql"): "mysql+pymysql://",
}


def require_immediate(alias: str, who: str, setting: str) -> None:
    """On SQLite, Django's database ``alias`` must begin its transactions ``IMMEDIATE``.

    Several processes write the one file (beats, workers). A deferred
    transaction that read first and then writes upgrades its read lock, and
    SQLite fails that at once with ``database is locked`` rather than wait
    for the other writer. Raises :class:`ConfigurationError` for ``who``,
    naming ``setting``.
    """
    from django.db import connections

    connection = connections[alias]
    mode = (connection.settings_dict.get("OPTIONS") or {}).get("transaction_mode")
    if connection.vendor == "sqlite" and str(mode).upper() != "IMMEDIATE":
        raise exceptions.ConfigurationError(
            f"{who}: a SQLite database needs "
            f"DATABASES[{alias!r}]['OPTIONS']['transaction_mode'] = 'IMMEDIATE' (Django 5.1+): "
            "a deferred transaction cannot wait for the write lock, and concurrent "
            "writers would fail with 'database is locked'",
            setting=setting,
        )


def engine_for(alias: str, borrowed: set[Any] | None = None) -> sa.Engine:
    """A SQLAlchemy engine whose connections are Django's connection ``alias`` (this thread's).

    Each Django connection it hands out is added to ``borrowed``, if given.
    """
    from django.db import connections

    connection = connections[alias]
    key = (connection.vendor, connection.Database.__name__.split(".")[0])
    if key not in _DRIVERS:
        raise exceptions.ConfigurationError(
            f"exactonce_store_url='django://{alias}': the database's driver "
            f"({connection.vendor}, {key[1]}) is not one the SQL store runs on "
            "(PostgreSQL with psycopg, SQLite, MySQL/MariaDB with mysqlclient or PyMySQL)",
            setting="exactonce_store_url",
        )

    def borrow() -> Any:
        current = connections[alias]  # this thread's connection
        current.ensure_connection()
        if borrowed is not None:
            borrowed.add(current)
        return current.connection

    engine = sa.create_engine(
        _DRIVERS[key], creator=borrow, poolclass=NullPool, pool_reset_on_return=None
    )
    # Django's connection is borrowed: Django's atomic blocks commit and roll back,
    # and Django closes it. This engine's dialect (its own instance) leaves all three.
    for method in ("do_commit", "do_rollback", "do_close", "do_terminate"):
        setattr(engine.dialect, method, _leave_to_django)
    return engine


def _leave_to_django(*_args: Any) -> None:
    """What SQLAlchemy would do to a connection Django owns: nothing."""
