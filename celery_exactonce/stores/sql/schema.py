"""The schema of the SQL job store: tables, indexes, versions and upgrades.

One :class:`Tables` per table prefix. Every time is a ``BIGINT`` of integer
microseconds since the UNIX epoch (no time zones, no driver conversions).
String columns that take part in a key or an ``ORDER BY`` compare by code
point on every dialect: ``COLLATE "C"`` on PostgreSQL, a binary *no-pad*
collation on MySQL/MariaDB (so ``"a"`` and ``"a "`` or ``"A"`` stay different
jobs, as they are in memory), ``BINARY`` (the default) on SQLite.

The jobs table's indexes (:func:`job_indexes`) depend on the dialect: on
PostgreSQL each covers only the rows its queries read (partial indexes), so a
job's row versions cost no index entry they do not need; MySQL/MariaDB have
no partial index, and SQLite would not use these (a query's ``state = ?``
does not prove an index's ``state IN (...)`` there), so both keep full ones.

Upgrades run step by step (:data:`UPGRADES`: version ``n`` to ``n + 1``, under
the lock on the schema row; version 2 changed the jobs table's indexes), each
tolerating tables :func:`create` made in their new shape, and another process
making the same change. A table added since is made by :func:`create` alone.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql

from celery_exactonce.core import exceptions
from celery_exactonce.core.states import LIVE, TERMINAL, State

#: The schema version this code writes (the SQL stores'; the Redis key format has its own).
SCHEMA_VERSION = 2
#: The jobs table's ``autovacuum_vacuum_scale_factor`` on PostgreSQL (since version 2;
#: the server's: 0.2). Each write of a live job leaves a dead row version (and index
#: entries), held until autovacuum comes at that share of the rows: at 0.2 a terminal
#: job cost about 60 bytes more (docs/design/scale.md).
JOBS_VACUUM_SCALE = 0.05
VACUUM_DDL = f"ALTER TABLE %(table)s SET (autovacuum_vacuum_scale_factor = {JOBS_VACUUM_SCALE})"
#: Attempts at creating the tables when another process creates them at once.
_CREATE_ATTEMPTS = 5


@dataclasses.dataclass(frozen=True)
class Tables:
    """The tables of one prefix."""

    prefix: str
    metadata: sa.MetaData
    jobs: sa.Table
    watermarks: sa.Table
    leases: sa.Table
    meta: sa.Table
    schema: sa.Table
    skipped: sa.Table
    entries: sa.Table
    unique: sa.Table

    @property
    def per_namespace(self) -> tuple[sa.Table, ...]:
        """The tables whose rows belong to a namespace (all but the schema version)."""
        return (self.jobs, self.watermarks, self.leases, self.meta, self.skipped, self.entries,
                self.unique)  # fmt: skip


def _key(length: int) -> sa.types.TypeEngine[str]:
    """A short string compared by code point (``COLLATE "C"`` on PostgreSQL)."""
    return sa.String(length).with_variant(postgresql.VARCHAR(length, collation="C"), "postgresql")


def _text() -> sa.types.TypeEngine[str]:
    """A JSON document of up to 16 MiB (``TEXT`` is 64 KiB on MySQL)."""
    return sa.Text().with_variant(mysql.MEDIUMTEXT(), "mysql", "mariadb")


def _states(states: frozenset[State]) -> str:
    """``state IN (...)`` of ``states``: constants of the code, in a partial index's ``WHERE``."""
    return "state IN ({})".format(", ".join(f"'{s.value}'" for s in sorted(states)))


def job_indexes(prefix: str, dialect: str | None) -> list[sa.Index]:
    """The jobs table's indexes on ``dialect`` (``None``: the portable ones).

    PostgreSQL: ``jobs_live`` and ``jobs_ended``, ``(namespace, state, space,
    touched_at)`` over the live and the terminal rows (``list_stale``, and
    ``purge_expired`` per state and key space), and ``jobs_pending``,
    ``(namespace, run_at)`` over the ``PENDING`` rows (``claim_due``,
    ``due_backlog``). Every update of a job changes its state, so each writes
    an entry in every index: a live index empties again once its jobs end,
    and a terminal job costs one entry, in ``jobs_ended`` (and its key).
    Elsewhere ``jobs_states`` over every row and ``jobs_due``
    ``(namespace, state, run_at)``.
    """
    ordered = ("namespace", "state", "space", "touched_at")
    if dialect == "postgresql":
        return [
            sa.Index(f"{prefix}jobs_live", *ordered, postgresql_where=sa.text(_states(LIVE))),
            sa.Index(f"{prefix}jobs_ended", *ordered, postgresql_where=sa.text(_states(TERMINAL))),
            sa.Index(
                f"{prefix}jobs_pending",
                "namespace",
                "run_at",
                postgresql_where=sa.text(f"state = '{State.PENDING.value}'"),
            ),
        ]
    return [
        sa.Index(f"{prefix}jobs_states", *ordered),
        sa.Index(f"{prefix}jobs_due", "namespace", "state", "run_at"),
    ]


#: The jobs table's indexes of schema version 1, which version 2 dropped (by dialect).
V1_DROPPED = {
    "postgresql": ("jobs_stale", "jobs_due", "jobs_expiry"),
    None: ("jobs_stale", "jobs_expiry"),
}


def build(
    prefix: str, *, mysql_collation: str = "utf8mb4_bin", dialect: str | None = None
) -> Tables:
    """The tables of ``prefix`` (validated by the store) in a fresh metadata.

    ``dialect`` says which indexes the jobs table has (:func:`job_indexes`):
    what :func:`create` makes. The statements never name an index.
    """
    md = sa.MetaData()
    opts: dict[str, Any] = {
        "mysql_engine": "InnoDB",
        "mysql_charset": "utf8mb4",
        "mysql_collate": mysql_collation,
    }
    jobs = sa.Table(
        f"{prefix}jobs",
        md,
        # The fixed-width columns first, widest first: on PostgreSQL a BIGINT after
        # text is aligned to 8 bytes, and each gap costs a row up to 7 (since version 2;
        # a table upgraded from version 1 keeps its order).
        sa.Column("fire_time", sa.BigInteger),
        sa.Column("run_at", sa.BigInteger),
        sa.Column("deadline", sa.BigInteger),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        sa.Column("touched_at", sa.BigInteger, nullable=False),
        sa.Column("heartbeat_at", sa.BigInteger),
        sa.Column("terminal_at", sa.BigInteger),
        sa.Column("expires_at", sa.BigInteger),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("dispatches", sa.Integer, nullable=False),
        sa.Column("namespace", _key(64), primary_key=True),
        sa.Column("space", _key(1), primary_key=True),
        sa.Column("id", _key(200), primary_key=True),
        sa.Column("task", sa.String(255), nullable=False),
        sa.Column("state", _key(16), nullable=False),
        sa.Column("rev", sa.String(255), nullable=False),
        sa.Column("run_id", sa.String(255)),
        sa.Column("payload", _text(), nullable=False),
        sa.Column("entry", sa.String(255)),
        sa.Column("node", sa.String(255), nullable=False),
        sa.Column("reason", sa.String(500), nullable=False),
        sa.Column("history", _text(), nullable=False),
        *job_indexes(prefix, dialect),
        **opts,
    )
    # PostgreSQL keeps no statistics of a job's namespace and key space. A
    # namespace the last ANALYZE did not see (a new one, or the tables analyzed
    # when another filled them) would be estimated at no rows, and a lookup by
    # the key would then go by any index led by the namespace, reading all of its
    # jobs. Without statistics the key's three equalities always pick the key.
    sa.event.listen(
        jobs,
        "after_create",
        sa.DDL(  # type: ignore[no-untyped-call]
            "ALTER TABLE %(table)s ALTER COLUMN namespace SET STATISTICS 0,"
            " ALTER COLUMN space SET STATISTICS 0"
        ).execute_if(dialect="postgresql"),
    )
    sa.event.listen(
        jobs,
        "after_create",
        sa.DDL(VACUUM_DDL).execute_if(dialect="postgresql"),  # type: ignore[no-untyped-call]
    )
    watermarks = sa.Table(
        f"{prefix}watermarks",
        md,
        sa.Column("namespace", _key(64), primary_key=True),
        sa.Column("entry", _key(255), primary_key=True),
        sa.Column("fire_time", sa.BigInteger),
        **opts,
    )
    leases = sa.Table(
        f"{prefix}leases",
        md,
        sa.Column("namespace", _key(64), primary_key=True),
        sa.Column("name", _key(255), primary_key=True),
        sa.Column("token", sa.String(255), nullable=False),
        sa.Column("expires_at", sa.BigInteger, nullable=False),
        **opts,
    )
    meta = sa.Table(
        f"{prefix}meta",
        md,
        sa.Column("namespace", _key(64), primary_key=True),
        sa.Column("epoch", sa.String(64), nullable=False),
        **opts,
    )
    schema = sa.Table(
        f"{prefix}schema",
        md,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("version", sa.Integer, nullable=False),
        **opts,
    )
    # Records of skipped slots, for people (note_skipped): appended, read newest first,
    # pruned past the retention. Made by setup() like every table (create_all, checkfirst),
    # so a database of schema version 1 made before it gets it without an upgrade.
    skipped = sa.Table(
        f"{prefix}skipped",
        md,
        sa.Column(
            "seq",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("namespace", _key(64), nullable=False),
        sa.Column("entry", sa.String(255), nullable=False),
        sa.Column("reason", sa.String(16), nullable=False),
        sa.Column("first_slot", sa.BigInteger, nullable=False),
        sa.Column("last_slot", sa.BigInteger, nullable=False),
        sa.Column("slots", sa.Integer, nullable=False),
        sa.Column("node", sa.String(255), nullable=False),
        sa.Column("noted_at", sa.BigInteger, nullable=False),
        sa.Index(f"{prefix}skipped_recent", "namespace", "noted_at"),
        **opts,
    )
    # Stored beat entries (celery_exactonce.entries): a definition per name, and under the
    # empty name (no entry's) the revision every write moves. Made by setup() as the
    # skipped slots' table is (and the unique keys' one: a key's last job, stores.unique).
    entries = sa.Table(
        f"{prefix}entries",
        md,
        sa.Column("revision", sa.BigInteger, nullable=False),
        sa.Column("changed_at", sa.BigInteger, nullable=False),
        sa.Column("namespace", _key(64), primary_key=True),
        sa.Column("name", _key(255), primary_key=True),
        sa.Column("definition", _text(), nullable=False),
        **opts,
    )
    unique = sa.Table(
        f"{prefix}unique", md, sa.Column("namespace", _key(64), primary_key=True),
        sa.Column("ukey", _key(66), primary_key=True),
        sa.Column("holder", sa.String(255), nullable=False), **opts,
    )  # fmt: skip
    return Tables(prefix, md, jobs, watermarks, leases, meta, schema, skipped, entries, unique)


def mysql_collation(dialect: sa.Dialect) -> str:
    """A binary, no-pad utf8mb4 collation the server has (MariaDB or MySQL 8)."""
    if getattr(dialect, "is_mariadb", False):
        return "utf8mb4_nopad_bin"
    version = getattr(dialect, "server_version_info", None) or (0,)
    return "utf8mb4_0900_bin" if version >= (8, 0, 17) else "utf8mb4_bin"


def _index_names(conn: sa.Connection, table: str) -> set[str]:
    return {str(ix["name"]) for ix in sa.inspect(conn).get_indexes(table)}


def _upgrade_1(conn: sa.Connection, tables: Tables) -> None:
    """Version 1 to 2: the jobs table's indexes of :func:`job_indexes`.

    Version 1 indexed every row on ``(namespace, state, touched_at)``,
    ``(namespace, state, run_at)`` and ``(namespace, expires_at)``. Each index
    is made where absent and dropped where present, so a table :func:`create`
    made in the new shape, or one another process changes at the same time
    (MySQL commits each DDL statement, and with it releases the schema row's
    lock), ends the same. ``CREATE INDEX`` blocks writes to the table while it
    reads it (about a second per million jobs).
    """
    ddl = ddl_tables(conn, tables.prefix)
    name = ddl.jobs.name
    dialect = "postgresql" if conn.dialect.name == "postgresql" else None
    for index in ddl.jobs.indexes:
        if index.name not in _index_names(conn, name):
            _tolerant(conn, sa.schema.CreateIndex(index), name, str(index.name), present=True)
    for suffix in V1_DROPPED[dialect]:
        old = f"{tables.prefix}{suffix}"
        if old in _index_names(conn, name) and old not in {i.name for i in ddl.jobs.indexes}:
            drop = sa.schema.DropIndex(sa.Index(old, ddl.jobs.c.namespace))
            _tolerant(conn, drop, name, old, present=False)
    if dialect == "postgresql":
        quoted = conn.dialect.identifier_preparer.format_table(ddl.jobs)
        conn.execute(sa.text(VACUUM_DDL % {"table": quoted}))


def _tolerant(
    conn: sa.Connection,
    ddl: sa.schema.ExecutableDDLElement,
    table: str,
    index: str,
    *,
    present: bool,
) -> None:
    """Run ``ddl``; its error ignored if ``index`` ends as wanted anyway (another
    process made the same change first)."""
    try:
        conn.execute(ddl)
    except sa.exc.DBAPIError:
        if (index in _index_names(conn, table)) != present:
            raise


def v1_indexes(tables: Tables) -> list[sa.Index]:
    """The jobs table's indexes of schema version 1, on every dialect."""
    p, jobs = tables.prefix, tables.jobs.c
    return [
        sa.Index(f"{p}jobs_stale", jobs.namespace, jobs.state, jobs.touched_at),
        sa.Index(f"{p}jobs_due", jobs.namespace, jobs.state, jobs.run_at),
        sa.Index(f"{p}jobs_expiry", jobs.namespace, jobs.expires_at),
    ]


def downgrade_to_1(conn: sa.Connection, tables: Tables) -> None:
    """Version 2 to 1 (Django's migration backwards): the indexes of version 1, and a
    compacted payload (``''``) written as version 1 reads it; then the version."""
    ddl = ddl_tables(conn, tables.prefix)
    name = ddl.jobs.name
    for index in v1_indexes(ddl):
        if index.name not in _index_names(conn, name):
            _tolerant(conn, sa.schema.CreateIndex(index), name, str(index.name), present=True)
    for index in job_indexes(tables.prefix, conn.dialect.name):
        if index.name in _index_names(conn, name) and index.name != f"{tables.prefix}jobs_due":
            drop = sa.schema.DropIndex(sa.Index(index.name, ddl.jobs.c.namespace))
            _tolerant(conn, drop, name, str(index.name), present=False)
    jobs = tables.jobs
    if conn.dialect.name == "postgresql":
        quoted = conn.dialect.identifier_preparer.format_table(jobs)
        conn.execute(sa.text(f"ALTER TABLE {quoted} RESET (autovacuum_vacuum_scale_factor)"))
    conn.execute(jobs.update().where(jobs.c.payload == "").values(payload=V1_COMPACT_PAYLOAD))
    conn.execute(tables.schema.update().where(tables.schema.c.id == 1).values(version=1))


#: A payload that keeps nothing as version 1 wrote it.
V1_COMPACT_PAYLOAD = '{"args":[],"kwargs":{},"options":{}}'


#: ``UPGRADES[n]`` moves a database from version ``n`` to ``n + 1``, in the
#: transaction that holds the schema row locked.
UPGRADES: dict[int, Callable[[sa.Connection, Tables], None]] = {1: _upgrade_1}


def stored_version(conn: sa.Connection, tables: Tables, *, lock: bool = False) -> int | None:
    """The version recorded in the schema table, ``None`` when there is none (or no table)."""
    if not sa.inspect(conn).has_table(tables.schema.name):
        return None
    query = sa.select(tables.schema.c.version).where(tables.schema.c.id == 1)
    if lock and conn.dialect.name != "sqlite":
        query = query.with_for_update()
    value = conn.execute(query).scalar_one_or_none()
    return None if value is None else int(value)


def refuse_newer(version: int | None, where: str) -> None:
    if version is not None and version > SCHEMA_VERSION:
        raise exceptions.SchemaMismatch(
            f"{where} holds schema version {version}; this celery-exactonce writes "
            f"version {SCHEMA_VERSION}: upgrade celery-exactonce (never mix versions)"
        )


def ddl_tables(conn: sa.Connection, prefix: str) -> Tables:
    """The tables of ``prefix`` as :func:`create` makes them on ``conn``'s dialect."""
    name = conn.dialect.name
    if name in ("mysql", "mariadb"):
        return build(prefix, mysql_collation=mysql_collation(conn.dialect), dialect=name)
    return build(prefix, dialect=name)


def create(engine: sa.Engine, tables: Tables, where: str) -> None:
    """Create absent tables and indexes, record or upgrade the version. Idempotent.

    Safe when several processes run it at once: a ``CREATE`` that loses the
    race ("already exists") is retried, and ``checkfirst`` then skips what the
    winner made.
    """
    with engine.connect() as conn, conn.begin():
        refuse_newer(stored_version(conn, tables), where)
    for attempt in range(_CREATE_ATTEMPTS):
        try:
            with engine.connect() as conn, conn.begin():
                ddl_tables(conn, tables.prefix).metadata.create_all(conn, checkfirst=True)
            break
        except sa.exc.DBAPIError:
            if attempt + 1 == _CREATE_ATTEMPTS:
                raise
            time.sleep(0.05 * (attempt + 1))
    for attempt in range(_CREATE_ATTEMPTS):
        try:
            with engine.connect() as conn, conn.begin():
                _record_version(conn, tables, where)
            return
        except sa.exc.IntegrityError:
            # Two first set-ups inserted the version row at once: read it again.
            if attempt + 1 == _CREATE_ATTEMPTS:
                raise


def _record_version(conn: sa.Connection, tables: Tables, where: str) -> None:
    version = stored_version(conn, tables, lock=True)
    refuse_newer(version, where)
    if version is None:
        conn.execute(tables.schema.insert().values(id=1, version=SCHEMA_VERSION))
        return
    while version < SCHEMA_VERSION:
        UPGRADES[version](conn, tables)
        version += 1
        conn.execute(tables.schema.update().where(tables.schema.c.id == 1).values(version=version))
