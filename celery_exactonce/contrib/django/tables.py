"""The store's tables as the Django app makes them: their prefix, and the DDL of the migrations.

The tables' DDL is the SQL store's own (:func:`celery_exactonce.stores.sql.schema.create`),
run by SQLAlchemy on the connection the migration runs on, inside the
migration's transaction: one definition of the tables for every way they are
made. The admin reads the jobs through a view (:func:`create_view`) that
gives each record the one-column key Django's admin needs:
``namespace:space:id`` (a namespace holds no ``:``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery_exactonce.contrib.django.connection import engine_for
from celery_exactonce.stores.sql import schema as sql_schema

DEFAULT_PREFIX = "exactonce_"


def prefix() -> str:
    """The tables' prefix: the ``EXACTONCE_TABLE_PREFIX`` Django setting, else ``exactonce_``."""
    from django.conf import settings

    value: str = getattr(settings, "EXACTONCE_TABLE_PREFIX", DEFAULT_PREFIX)
    return value


def create(apps: Any, schema_editor: Any) -> None:
    """Migration step: create the tables and record the schema version (idempotent)."""
    alias = schema_editor.connection.alias
    sql_schema.create(engine_for(alias), sql_schema.build(prefix()), f"django store {alias!r}")


def drop(apps: Any, schema_editor: Any) -> None:
    """Migration step, backwards: drop the tables (and every job in them)."""
    engine = engine_for(schema_editor.connection.alias)
    with engine.connect() as conn:
        sql_schema.build(prefix()).metadata.drop_all(conn)


def downgrade_to_1(apps: Any, schema_editor: Any) -> None:
    """Migration step, backwards: the schema of version 1 (:func:`sql_schema.downgrade_to_1`)."""
    engine = engine_for(schema_editor.connection.alias)
    with engine.connect() as conn:
        sql_schema.downgrade_to_1(conn, sql_schema.build(prefix()))


def dropping(table: str) -> Callable[[Any, Any], None]:
    """Migration step, backwards: drop one table added by a later migration (``skipped``...)."""

    def drop_table(apps: Any, schema_editor: Any) -> None:
        engine = engine_for(schema_editor.connection.alias)
        with engine.connect() as conn:
            getattr(sql_schema.build(prefix()), table).drop(conn, checkfirst=True)

    return drop_table


#: The records of skipped slots, the stored beat entries, the unique keys.
drop_skipped, drop_entries, drop_unique = (dropping(t) for t in ("skipped", "entries", "unique"))


#: The admin's views: view suffix -> (table suffix, the columns of its key).
VIEWS = {
    "admin_jobs": ("jobs", ("namespace", "space", "id")),
    "admin_watermarks": ("watermarks", ("namespace", "entry")),
}


def view_name(suffix: str) -> str:
    """The name of one of :data:`VIEWS` under the tables' prefix."""
    return f"{prefix()}{suffix}"


def _key_sql(vendor: str, columns: tuple[str, ...]) -> str:
    if vendor == "mysql":
        return "CONCAT({})".format(", ':', ".join(columns))
    return " || ':' || ".join(columns)


def create_views(apps: Any, schema_editor: Any) -> None:
    """Migration step: the admin's views, each row keyed by its columns joined with ``:``."""
    quote = schema_editor.quote_name
    for suffix, (table, columns) in VIEWS.items():
        key = _key_sql(schema_editor.connection.vendor, columns)
        source = quote(f"{prefix()}{table}")
        # Names from a validated prefix and constants, quoted: no input reaches this SQL.
        schema_editor.execute(
            f"CREATE VIEW {quote(view_name(suffix))} AS "  # noqa: S608
            f"SELECT {key} AS pk, {source}.* FROM {source}"
        )


def drop_views(apps: Any, schema_editor: Any) -> None:
    """Migration step, backwards: drop the admin's views."""
    for suffix in VIEWS:
        schema_editor.execute(f"DROP VIEW IF EXISTS {schema_editor.quote_name(view_name(suffix))}")
