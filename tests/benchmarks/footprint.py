"""The store's footprint: bytes per terminal job on each store, and the steady state.

``python -m tests.benchmarks --suite footprint`` fills each store with ``N``
terminal jobs, written as the package writes them, half of each kind:

* **beat occurrences** of distinct plain entries, one slot: beat's claim
  (``SCHEDULED``, the entry's watermark advanced), the ``DISPATCHED`` write
  and ``PUBLISHED``;
* **gated jobs** of ``.delay()``: written ``DISPATCHED`` by the store's
  ``enqueue`` (the one-write submit; created ``SCHEDULED`` then moved where a
  store has none), the gate's ``RUNNING`` and the completion's ``SUCCEEDED``,
  each job's writes alone, as a submit and a worker make them.

and reports the bytes the fill added, per job:

* **Redis**: ``used_memory`` of a private ``redis-server`` (no other client
  writes to it), before and after the fill;
* **PostgreSQL**: ``pg_total_relation_size`` (table, TOAST and indexes) of the
  fill's own tables (a table prefix of its own), after ``VACUUM ANALYZE``,
  less the same tables empty, with each relation's share;
* **MariaDB**: ``data_length + index_length`` of those tables after ``ANALYZE
  TABLE`` (InnoDB's page counts, approximate);
* **SQLite**: the database file's pages in use, after ``VACUUM``.

The SQL fills are vacuumed as autovacuum would vacuum them (:class:`Autovacuum`),
and never by the daemon itself (it is turned off for the fill's tables on
PostgreSQL): the tables are vacuumed each time the row versions the fill left
dead in the jobs table pass ``50 +`` its ``autovacuum_vacuum_scale_factor``
of its rows (the table's own on PostgreSQL, 5% since schema version 2;
elsewhere PostgreSQL's default, 20%). A row's dead
versions leave room that later rows fill, so how often a table is vacuumed
is part of what a job costs; the same rule each run makes the figure repeat.
The measure itself follows one last vacuum: a steady state holds that much
plus, between two vacuums, up to 20% of its rows in dead versions.

Then the **steady state** on Redis (:func:`steady_state`): jobs of
``E`` entries every ``P`` seconds with a retention of ``R`` seconds, purged as
the reconciler purges, measured once it has stopped growing, beside the
formula of docs/design/scale.md, which it must be within 20% of.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from celery_exactonce.beat import claims
from celery_exactonce.beat.claimer import CLAIM_BATCH
from celery_exactonce.beat.entries import occurrence_id
from celery_exactonce.core.jobs import KEEP, Compaction
from celery_exactonce.core.refs import JobRef, new_token
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.dispatch.dispatcher import BEAT_REASON
from celery_exactonce.dispatch.messages import GATED_OPTION, POLICY_OPTION
from celery_exactonce.stores import store_from_url
from celery_exactonce.stores.base import StateStore
from tests import services

#: A node id as the package makes one (``hostname:pid``).
NODE = "bench-host-01:12345"
#: How far the measured steady state may be from the formula's.
FORMULA_TOLERANCE = 0.2
#: Targets, bytes per terminal job, by store.
TARGETS = {"redis": 700, "postgres": 500}
STORE_NAMES = {"redis": "Redis", "postgres": "PostgreSQL", "mysql": "MariaDB", "sqlite": "SQLite"}


@dataclass(frozen=True)
class Footprint:
    """What one fill of ``jobs`` terminal jobs added to a store, in bytes."""

    store: str
    jobs: int
    added: int
    what: str
    sample: dict[str, int]
    """Bytes of one record of each kind, where the store tells (Redis ``MEMORY USAGE``)."""
    parts: dict[str, int] = dataclasses.field(default_factory=dict)
    """Bytes the fill added to each relation, where the store tells (PostgreSQL)."""

    @property
    def per_job(self) -> float:
        return self.added / self.jobs


def _write(store: StateStore, requests: Sequence[tuple[JobRef, Transition]]) -> None:
    for result in store.transition_many(requests, brief=True):
        if not result.applied:
            raise AssertionError(f"a write of the fill did not apply: {result.status}")


def _step(
    store: StateStore,
    items: Sequence[tuple[JobRef, dict[str, Any]]],
    src: State,
    to: State,
    reason: str,
) -> list[tuple[JobRef, Transition]]:
    """Move each of ``items`` (a ref, its guards) from ``src`` to ``to``: one brief batch."""
    requests = [
        (ref, Transition(to, frozenset({src}), node=NODE, reason=reason, **guards))
        for ref, guards in items
    ]
    _write(store, requests)
    return requests


def _plain(store: StateStore, batch: Sequence[NewJob], epoch: str) -> None:
    got = claims.claim(store, batch, epoch=epoch, now=store.now())
    if len(got.won) != len(batch):
        raise AssertionError(f"won {len(got.won)} of {len(batch)}")
    items = [(new.ref, {"rev": new.rev}) for new in batch]
    dispatched = _step(store, items, State.SCHEDULED, State.DISPATCHED, BEAT_REASON)
    items = [(ref, {"rev": t.new_rev}) for ref, t in dispatched]
    _step(store, items, State.DISPATCHED, State.PUBLISHED, "publish returned")


def gated_jobs(count: int, start: int = 0) -> list[NewJob]:
    """``count`` jobs as a gated ``.delay(i)`` makes them (a Celery task id each)."""
    options = {
        "ignore_result": False,
        "reply_to": str(uuid.uuid4()),
        GATED_OPTION: True,
        POLICY_OPTION: {},
    }
    return [
        NewJob(
            JobRef.submitted(str(uuid.uuid4())),
            "bench.tasks.add",
            State.SCHEDULED,
            node=NODE,
            args=[start + i],
            options=options,
            reason="apply_async",
        )
        for i in range(count)
    ]


def _gated(store: StateStore, batch: Sequence[NewJob]) -> None:
    enqueue = getattr(store, "enqueue", None)
    reason = "apply_async"
    if enqueue is None:
        for result in store.create_many(batch, brief=True):
            if not result.created:
                raise AssertionError(f"a create of the fill did not apply: {result.status}")
        items = [(new.ref, {"rev": new.rev}) for new in batch]
        _step(store, items, State.SCHEDULED, State.DISPATCHED, reason)
    else:
        for new in batch:
            to = Transition(
                State.DISPATCHED,
                frozenset({State.SCHEDULED}),
                node=NODE,
                reason=reason,
                rev=new.rev,
            )
            if not enqueue(new, to).created:
                raise AssertionError(f"an enqueue of the fill did not apply: {new.ref}")
    for new in batch:  # a worker: the gate's write, then the completion's
        ((_, running),) = _step(
            store,
            [(new.ref, {"attempt": 0, "new_run_id": new_token()})],
            State.DISPATCHED,
            State.RUNNING,
            "gate",
        )
        _step(
            store,
            [(new.ref, {"run_id": running.new_run_id})],
            State.RUNNING,
            State.SUCCEEDED,
            "succeeded",
        )


def occurrences(store: StateStore, entries: int, slots: int, last: datetime) -> list[NewJob]:
    """``slots`` occurrences of each of ``entries`` plain entries, a second apart up to ``last``.

    In slot order, as beat claims them (each claim advances its entry's watermark).
    """
    fires = [last - timedelta(seconds=slots - 1 - k) for k in range(slots)]
    return [
        NewJob(
            JobRef.occurrence(occurrence_id(store.namespace, f"entry-{i:06}", fire)),
            "bench.tasks.tick",
            State.SCHEDULED,
            node=NODE,
            args=[i],
            options={GATED_OPTION: False},
            entry=f"entry-{i:06}",
            fire_time=fire,
            reason="beat claim",
        )
        for fire in fires
        for i in range(entries)
    ]


#: Slots of each entry in a fill: the entries' watermarks are shared by their slots' jobs.
SLOTS = 10


def fill(
    store: StateStore,
    count: int,
    *,
    chunks: int = 1,
    between: Callable[[], object] = lambda: None,
) -> None:
    """``count`` terminal jobs in ``store``: half beat occurrences (:data:`SLOTS` of each
    entry), half gated jobs; in ``chunks``, ``between`` called after each."""
    epoch = store.epoch()
    start = store.now().replace(microsecond=0) - timedelta(seconds=SLOTS * (chunks + 1))
    size = count // chunks
    for chunk in range(chunks):
        entries = max(1, size // 2 // SLOTS)
        last = start + timedelta(seconds=SLOTS * (chunk + 1))
        plain = occurrences(store, entries, size // 2 // entries, last)
        gated = gated_jobs(size - len(plain))
        for i in range(0, len(plain), CLAIM_BATCH):
            _plain(store, plain[i : i + CLAIM_BATCH], epoch)
        for i in range(0, len(gated), CLAIM_BATCH):
            _gated(store, gated[i : i + CLAIM_BATCH])
        between()


# -- per store -----------------------------------------------------------------------------


def _used_memory(client: Any) -> int:
    return int(client.info("memory")["used_memory"])


def _samples(client: Any) -> dict[str, int]:
    """``MEMORY USAGE`` of one record of each kind."""
    out = {}
    for kind, pattern in (("beat occurrence", "*:job:o:*"), ("gated job", "*:job:t:*")):
        key = next(iter(client.scan_iter(match=pattern, count=1000)), None)
        if key is not None:
            out[kind] = int(client.memory_usage(key, samples=0))
    return out


@contextmanager
def private_redis() -> Iterator[Any]:
    """A redis-server of this run's own (no persistence), killed by pid at the end.

    Warmed first: the scripts loaded (Redis keeps them, about 150 kB) by a fill
    of a namespace then dropped, so that what a measure adds is its jobs'.
    """
    from tests.integration.redis_server import redis_server

    with redis_server() as server:
        warm = store_from_url(server.url, namespace="warm-up")
        try:
            warm.setup()
            fill(warm, 2 * CLAIM_BATCH)
            warm.purge_expired(1)
            warm.drop_namespace()  # type: ignore[attr-defined]
        finally:
            warm.close()
        yield server


def measure_redis(count: int, compaction: Compaction = KEEP) -> Footprint:
    with private_redis() as server:
        client = server.client()
        store = store_from_url(server.url, namespace="default", compaction=compaction)
        try:
            store.setup()
            before = _used_memory(client)
            fill(store, count)
            added = _used_memory(client) - before
            return Footprint("redis", count, added, "used_memory", _samples(client))
        finally:
            store.close()


def _pg_parts(conn: Any, tables: Sequence[str]) -> dict[str, int]:
    """Each of ``tables``' relations (heap, TOAST, every index) and its size."""
    import sqlalchemy as sa

    query = sa.text(
        "SELECT c.relname, pg_table_size(c.oid) - pg_relation_size(c.oid, 'fsm')"
        " - pg_relation_size(c.oid, 'vm') FROM pg_class c WHERE c.relname = :t"
        " UNION ALL SELECT i.relname, pg_relation_size(i.oid) FROM pg_index x"
        " JOIN pg_class i ON i.oid = x.indexrelid"
        " JOIN pg_class c ON c.oid = x.indrelid WHERE c.relname = :t"
    )
    out: dict[str, int] = {}
    for table in tables:
        out.update((str(name), int(size)) for name, size in conn.execute(query, {"t": table}))
    return out


def _sql_sizes(engine: Any, tables: Sequence[str], parts: dict[str, int] | None = None) -> int:
    """The bytes ``tables`` hold, vacuumed first; each relation's in ``parts`` (PostgreSQL)."""
    import sqlalchemy as sa

    name = engine.dialect.name
    with engine.connect() as conn:
        if name == "postgresql":
            auto = conn.execution_options(isolation_level="AUTOCOMMIT")
            for table in tables:
                auto.execute(sa.text(f"VACUUM ANALYZE {table}"))
            if parts is not None:
                parts.update(_pg_parts(auto, tables))
            size = sa.text("SELECT pg_total_relation_size(:t)")
            return sum(int(auto.execute(size, {"t": t}).scalar_one()) for t in tables)
        if name in ("mysql", "mariadb"):
            for table in tables:
                conn.execute(sa.text(f"ANALYZE TABLE {table}")).fetchall()
            row = conn.execute(
                sa.text(
                    "SELECT COALESCE(SUM(data_length + index_length), 0) FROM "
                    "information_schema.tables WHERE table_schema = DATABASE() AND "
                    f"table_name IN ({', '.join(f':t{i}' for i in range(len(tables)))})"
                ),
                {f"t{i}": t for i, t in enumerate(tables)},
            ).scalar_one()
            return int(row)
    import sqlite3  # the store's engine opens its own transactions: one of our own

    db = sqlite3.connect(str(engine.url.database), isolation_level=None)
    try:
        db.execute("VACUUM")
        pages, free, size = (
            db.execute(f"PRAGMA {p}").fetchone()[0]
            for p in ("page_count", "freelist_count", "page_size")
        )
        return int((pages - free) * size)
    finally:
        db.close()


def _pg_vacuum_scale(engine: Any, table: str) -> float:
    """``table``'s ``autovacuum_vacuum_scale_factor``: its own, else the server's."""
    import sqlalchemy as sa

    with engine.connect() as conn:
        options = conn.execute(
            sa.text("SELECT reloptions FROM pg_class WHERE relname = :t"), {"t": table}
        ).scalar_one()
        for option in options or ():
            name, _, value = option.partition("=")
            if name == "autovacuum_vacuum_scale_factor":
                return float(value)
        return float(conn.execute(sa.text("SHOW autovacuum_vacuum_scale_factor")).scalar_one())


#: Jobs a fill writes between two looks at whether autovacuum would run.
VACUUM_STEP = 400
#: Row versions each job of a fill leaves dead in the jobs table: an occurrence is
#: inserted and updated twice (DISPATCHED, PUBLISHED); a gated job too (RUNNING, SUCCEEDED).
DEAD_PER_JOB = {"occurrence": 2, "gated": 2}


@dataclass
class Autovacuum:
    """When autovacuum would vacuum a fill's tables: once the dead row versions pass
    ``autovacuum_vacuum_threshold`` (50) plus ``scale`` (the jobs table's
    ``autovacuum_vacuum_scale_factor``) of the rows, counted by the fill itself (the
    server's own counters lag), so that every run vacuums at the same points."""

    vacuum: Callable[[], object]
    scale: float = 0.2
    jobs: int = 0
    dead: float = 0.0
    runs: int = 0

    def wrote(self, count: int) -> None:
        """A chunk of ``count`` jobs (half of each kind) is written: vacuum if due."""
        self.jobs += count
        self.dead += count / 2 * sum(DEAD_PER_JOB.values())
        if self.dead > 50 + self.scale * self.jobs:
            self.vacuum()
            self.dead, self.runs = 0.0, self.runs + 1


def measure_sql(backend: str, count: int, compaction: Compaction = KEEP) -> Footprint:
    import tempfile

    from tests.support.backends import store_url

    prefix = f"fp{uuid.uuid4().hex[:8]}_"
    url = store_url(backend, tempfile.mkdtemp(prefix="exactonce-footprint-"))
    store: Any = store_from_url(
        url, namespace="default", table_prefix=prefix, compaction=compaction
    )
    tables = [f"{prefix}jobs", f"{prefix}watermarks"]
    try:
        store.setup()
        engine = store._engine
        scale = 0.2
        if engine.dialect.name == "postgresql":
            scale = _pg_vacuum_scale(engine, tables[0])
            import sqlalchemy as sa

            with engine.begin() as conn:
                for table in tables:
                    conn.execute(sa.text(f"ALTER TABLE {table} SET (autovacuum_enabled = false)"))
        before: dict[str, int] = {}
        total = _sql_sizes(engine, tables, before)
        autovacuum = Autovacuum(lambda: _sql_sizes(engine, tables), scale)
        chunks = max(1, count // VACUUM_STEP)
        fill(store, count, chunks=chunks, between=lambda: autovacuum.wrote(count // chunks))
        after: dict[str, int] = {}
        added = _sql_sizes(engine, tables, after) - total
        what = {"postgresql": "table + index", "sqlite": "file pages"}.get(
            engine.dialect.name, "data + index"
        )
        what += f", {autovacuum.runs + 1} vacuums at {scale:g}"
        parts = {name.removeprefix(prefix): after[name] - before.get(name, 0) for name in after}
        return Footprint(backend, count, added, what, {}, parts)
    finally:
        _drop(store, prefix)


def _drop(store: Any, prefix: str) -> None:
    try:
        store._t.metadata.drop_all(store._engine)
    finally:
        store.close()


MEASURES: dict[str, Callable[[int, Compaction], Footprint]] = {
    "redis": measure_redis,
    "postgres": lambda n, c: measure_sql("postgres", n, c),
    "mysql": lambda n, c: measure_sql("mysql", n, c),
    "sqlite": lambda n, c: measure_sql("sqlite", n, c),
}
#: The settings measured: the defaults, and a terminal record compacted.
COMPACT = Compaction(history="none", payload=False)
SETTINGS = {"full": KEEP, "compact": COMPACT}


def run(stores: Sequence[str], count: int) -> list[tuple[str, Footprint]]:
    """Each store's footprint under each of :data:`SETTINGS`; a store that is down skipped."""
    out = []
    for name in stores:
        if name in services.SERVICE_URLS and not services.answers(name):
            print(f"footprint: {name} skipped, {services.SERVICE_URLS[name]} does not answer")
            continue
        out += [(setting, MEASURES[name](count, c)) for setting, c in SETTINGS.items()]
    return out


def table(rows: Sequence[tuple[str, Footprint]]) -> list[str]:
    """The footprint table: per store and setting, bytes per job beside the target."""
    lines = [
        f"{'store':<12}{'terminal':<10}{'jobs':>9}{'bytes added':>14}{'bytes/job':>11}"
        f"{'target':>9}  measured as",
    ]
    for setting, row in rows:
        target = TARGETS.get(row.store)
        bound = f"<= {target}" if target else "-"
        lines.append(
            f"{STORE_NAMES.get(row.store, row.store):<12}{setting:<10}{row.jobs:>9,}"
            f"{row.added:>14,}{row.per_job:>11,.0f}{bound:>9}  {row.what}"
        )
        for kind, size in row.sample.items():
            lines.append(f"{'':<22}one {kind}: MEMORY USAGE {size:,} bytes")
        for part, size in row.parts.items():
            lines.append(f"{'':<22}{part:<24}{size:>14,}{size / row.jobs:>11,.0f}")
    lines.append(
        "(full: the default settings; compact: exactonce_terminal_history='none', "
        "exactonce_terminal_payload=False)"
    )
    if any(row.parts for _, row in rows):
        lines.append(
            "(SQL: vacuumed during the fill as autovacuum would at the jobs table's scale "
            "factor, and once before the measure; between two vacuums a steady state holds "
            "up to that share of its rows more in dead row versions)"
        )
    return lines


# -- the steady state ----------------------------------------------------------------------


@dataclass(frozen=True)
class SteadyState:
    """A namespace's size once its jobs expire as fast as they come, measured and predicted."""

    entries: int
    period: float
    """Seconds between slots, as they came (a loaded machine runs them late)."""
    retention: float
    interval: float
    per_job: float
    """Bytes per terminal job, from a fill with the same settings (:func:`measure_redis`)."""
    jobs: float
    """Jobs held, the mean of the samples."""
    measured: float
    """``used_memory`` above the empty namespace, the mean of the samples."""

    @property
    def held(self) -> float:
        """The formula's jobs held: ``E x (R + I/2) / P``."""
        return self.entries * (self.retention + self.interval / 2) / self.period

    @property
    def predicted(self) -> float:
        """The formula of docs/design/scale.md: jobs held x bytes per job."""
        return self.held * self.per_job

    @property
    def error(self) -> float:
        return self.measured / self.predicted - 1


def steady_state(
    entries: int, period: float, retention: float, interval: float, per_job: float
) -> SteadyState:
    """``entries`` plain entries due every ``period`` s, purged every ``interval`` s.

    On a private Redis, with :data:`COMPACT` terminal records and a retention
    of ``retention`` s: each slot's occurrences claimed, dispatched and
    published as beat does, and ``purge_expired`` run as the reconciler runs
    it. Sampled each slot from ``retention + 2 x interval`` on, for as long again.
    """
    with private_redis() as server:
        client = server.client()
        store = store_from_url(
            server.url, namespace="default", retention=retention, compaction=COMPACT
        )
        try:
            store.setup()
            epoch = store.epoch()
            base = _used_memory(client)
            began = time.monotonic()
            settle, end = retention + 2 * interval, 2 * (retention + 2 * interval)
            next_purge, slot, samples = interval, 0, []
            settled_at, settled_slot = settle, 0
            first = store.now() - timedelta(seconds=1)
            while (elapsed := time.monotonic() - began) < end:
                if elapsed >= settle and not samples:
                    settled_at, settled_slot = elapsed, slot
                batch = occurrences(store, entries, 1, first + timedelta(seconds=slot * period))
                for i in range(0, len(batch), CLAIM_BATCH):
                    _plain(store, batch[i : i + CLAIM_BATCH], epoch)
                if elapsed >= next_purge:
                    while store.purge_expired(10_000):
                        pass
                    next_purge += interval
                if elapsed >= settle:
                    held = sum(store.count_by_state().values())
                    samples.append((held, _used_memory(client) - base))
                slot += 1
                time.sleep(max(0.0, began + slot * period - time.monotonic()))
            came = (time.monotonic() - began - settled_at) / (slot - settled_slot)
        finally:
            store.close()
    jobs = sum(s[0] for s in samples) / len(samples)
    measured = sum(s[1] for s in samples) / len(samples)
    return SteadyState(entries, max(period, came), retention, interval, per_job, jobs, measured)


def steady_lines(state: SteadyState) -> list[str]:
    return [
        f"\nsteady state on Redis (compact): {state.entries:,} entries every {state.period:.2f} s, "
        f"retention {state.retention:g} s, purged every {state.interval:g} s\n",
        f"{'jobs held, measured (mean)':<45}{state.jobs:>16,.0f}",
        f"{'jobs held, E x (R + I/2) / P':<45}{state.held:>16,.0f}",
        f"{'used_memory, measured (mean)':<45}{state.measured:>16,.0f}",
        f"{'formula: jobs held x ' + f'{state.per_job:,.0f} bytes/job':<45}"
        f"{state.predicted:>16,.0f}",
        f"{'measured / formula':<45}{state.measured / state.predicted:>15.2f}x"
        f"  ({'within' if abs(state.error) <= FORMULA_TOLERANCE else 'NOT within'} 20%)",
    ]
