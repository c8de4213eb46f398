"""The schema of the SQL job store: tables, indexes, versions and upgrades.

One :class:`Tables` per table prefix. Every time is a ``BIGINT`` of integer
microseconds since the UNIX epoch (no time zones, no driver conversions).
String columns that take part in a key or an ``ORDER BY`` compare by code
point on every dialect: ``COLLATE "C"`` on PostgreSQL, a binary *no-pad*
collation on MySQL/MariaDB (so ``"a"`` and ``"a "`` or ``"A"`` stay different
jobs, as they are in memory), ``BINARY`` (the default) on SQLite.

Upgrades run step by step: :data:`UPGRADES` maps a version ``n`` to the
function that moves a database from ``n`` to ``n + 1``. Only version 1 exists,
so the map is empty; version 2 adds ``UPGRADES[1]`` (and must tolerate tables
that :func:`create` already made in their new shape).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql

from celery_exactonce.core import exceptions, times
from celery_exactonce.core.jobs import HistoryEntry, Job
from celery_exactonce.core.payload import encode_payload
from celery_exactonce.core.refs import JobRef, Space
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.stores.base import FORMAT_VERSION

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

    @property
    def per_namespace(self) -> tuple[sa.Table, ...]:
        """The tables whose rows belong to a namespace (all but the schema version)."""
        return (self.jobs, self.watermarks, self.leases, self.meta, self.skipped)


def _key(length: int) -> sa.types.TypeEngine[str]:
    """A short string compared by code point (``COLLATE "C"`` on PostgreSQL)."""
    return sa.String(length).with_variant(postgresql.VARCHAR(length, collation="C"), "postgresql")


def _text() -> sa.types.TypeEngine[str]:
    """A JSON document of up to 16 MiB (``TEXT`` is 64 KiB on MySQL)."""
    return sa.Text().with_variant(mysql.MEDIUMTEXT(), "mysql", "mariadb")


def build(prefix: str, *, mysql_collation: str = "utf8mb4_bin") -> Tables:
    """The tables of ``prefix`` (validated by the store) in a fresh metadata."""
    md = sa.MetaData()
    opts: dict[str, Any] = {
        "mysql_engine": "InnoDB",
        "mysql_charset": "utf8mb4",
        "mysql_collate": mysql_collation,
    }
    jobs = sa.Table(
        f"{prefix}jobs",
        md,
        sa.Column("namespace", _key(64), primary_key=True),
        sa.Column("space", _key(1), primary_key=True),
        sa.Column("id", _key(200), primary_key=True),
        sa.Column("task", sa.String(255), nullable=False),
        sa.Column("state", _key(16), nullable=False),
        sa.Column("rev", sa.String(255), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("run_id", sa.String(255)),
        sa.Column("payload", _text(), nullable=False),
        sa.Column("entry", sa.String(255)),
        sa.Column("fire_time", sa.BigInteger),
        sa.Column("run_at", sa.BigInteger),
        sa.Column("deadline", sa.BigInteger),
        sa.Column("created_at", sa.BigInteger, nullable=False),
        sa.Column("touched_at", sa.BigInteger, nullable=False),
        sa.Column("heartbeat_at", sa.BigInteger),
        sa.Column("terminal_at", sa.BigInteger),
        sa.Column("expires_at", sa.BigInteger),
        sa.Column("dispatches", sa.Integer, nullable=False),
        sa.Column("node", sa.String(255), nullable=False),
        sa.Column("reason", sa.String(500), nullable=False),
        sa.Column("history", _text(), nullable=False),
        sa.Index(f"{prefix}jobs_stale", "namespace", "state", "touched_at"),
        sa.Index(f"{prefix}jobs_due", "namespace", "state", "run_at"),
        sa.Index(f"{prefix}jobs_expiry", "namespace", "expires_at"),
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
    return Tables(prefix, md, jobs, watermarks, leases, meta, schema, skipped)


def mysql_collation(dialect: sa.Dialect) -> str:
    """A binary, no-pad utf8mb4 collation the server has (MariaDB or MySQL 8)."""
    if getattr(dialect, "is_mariadb", False):
        return "utf8mb4_nopad_bin"
    version = getattr(dialect, "server_version_info", None) or (0,)
    return "utf8mb4_0900_bin" if version >= (8, 0, 17) else "utf8mb4_bin"


#: ``UPGRADES[n]`` moves a database from version ``n`` to ``n + 1``, in the
#: transaction that holds the schema row locked.
UPGRADES: dict[int, Callable[[sa.Connection, Tables], None]] = {}


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
    if version is not None and version > FORMAT_VERSION:
        raise exceptions.SchemaMismatch(
            f"{where} holds schema version {version}; this celery-exactonce writes "
            f"version {FORMAT_VERSION}: upgrade celery-exactonce (never mix versions)"
        )


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
                ddl = tables
                if conn.dialect.name == "mysql":
                    ddl = build(tables.prefix, mysql_collation=mysql_collation(conn.dialect))
                ddl.metadata.create_all(conn, checkfirst=True)
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
        conn.execute(tables.schema.insert().values(id=1, version=FORMAT_VERSION))
        return
    while version < FORMAT_VERSION:
        UPGRADES[version](conn, tables)
        version += 1
        conn.execute(tables.schema.update().where(tables.schema.c.id == 1).values(version=version))


# -- rows <-> jobs -------------------------------------------------------------------


def job_values(
    job: Job,
    namespace: str,
    retention: float,
    *,
    key: bool = True,
    payload: str | None = None,
    history: bool = True,
) -> dict[str, Any]:
    """The ``jobs`` row of ``job`` (without the primary key unless ``key``).

    ``expires_at`` is set only on terminal records: ``max(fire_time, terminal_at) + retention``.
    ``payload``: the ``payload`` column's text already encoded (:func:`new_payload`), if it is.
    Not ``history``: without the ``history`` column (a statement that writes it in pieces).
    """
    values: dict[str, Any] = {
        "task": job.task,
        "state": job.state.value,
        "rev": job.rev,
        "attempt": job.attempt,
        "run_id": job.run_id,
        "payload": payload or encode_payload(payload_document(job), context=str(job.ref)),
        "entry": job.entry,
        "fire_time": times.to_micros_opt(job.fire_time),
        "run_at": times.to_micros_opt(job.run_at),
        "deadline": times.to_micros_opt(job.deadline),
        "created_at": times.to_micros(job.created_at),
        "touched_at": times.to_micros(job.touched_at),
        "heartbeat_at": times.to_micros_opt(job.heartbeat_at),
        "terminal_at": times.to_micros_opt(job.terminal_at),
        "expires_at": times.to_micros_opt(job.expires_at(retention)),
        "dispatches": job.dispatches,
        "node": job.node,
        "reason": job.reason,
    }
    if history:
        values["history"] = json.dumps([h.to_json() for h in job.history], separators=(",", ":"))
    if key:
        values.update(namespace=namespace, space=job.ref.space.value, id=job.ref.id)
    return values


def job_from_row(row: sa.Row[Any]) -> Job:
    """Inverse of :func:`job_values`."""
    m = row._mapping
    payload = json.loads(m["payload"])
    return Job(
        ref=JobRef(Space(m["space"]), m["id"]),
        task=m["task"],
        state=State(m["state"]),
        rev=m["rev"],
        attempt=int(m["attempt"]),
        run_id=m["run_id"],
        args=list(payload["args"]),
        kwargs=dict(payload["kwargs"]),
        options=dict(payload["options"]),
        entry=m["entry"],
        fire_time=times.from_micros_opt(m["fire_time"]),
        run_at=times.from_micros_opt(m["run_at"]),
        deadline=times.from_micros_opt(m["deadline"]),
        created_at=times.from_micros(m["created_at"]),
        touched_at=times.from_micros(m["touched_at"]),
        heartbeat_at=times.from_micros_opt(m["heartbeat_at"]),
        terminal_at=times.from_micros_opt(m["terminal_at"]),
        dispatches=int(m["dispatches"]),
        node=m["node"],
        reason=m["reason"],
        history=tuple(HistoryEntry.from_json(h) for h in json.loads(m["history"])),
        signature=payload.get("signature") or None,
    )


def new_payload(new: NewJob) -> str | None:
    """The ``payload`` column of the record a create of ``new`` writes, from the texts ``new``
    encoded when it was built (:attr:`NewJob.payload_json`); ``None`` if it kept none."""
    texts = new.payload_json
    if texts is None:
        return None
    signed = "" if new.signature is None else f',"signature":{json.dumps(new.signature)}'
    return f'{{"args":{texts[0]},"kwargs":{texts[1]},"options":{texts[2]}{signed}}}'


def payload_document(job: Job) -> dict[str, Any]:
    """The ``payload`` column's JSON: args, kwargs, options, and the signature if any.

    The signature lives in the document it signs, so one write changes both,
    and tables of schema version 1 hold it without an upgrade (a reader that
    does not know the key ignores it).
    """
    document = job.payload
    if job.signature is not None:
        document["signature"] = job.signature
    return document
