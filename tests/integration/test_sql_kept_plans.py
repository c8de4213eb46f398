"""The gate's two writes on PostgreSQL keep a generic plan: it must find the row by its key.

A generic plan is made once, with the tables as they are then, and kept: if
it were made while the jobs table was empty (a new store, statistics that
say so after a ``VACUUM``), a plan that reads the table would read every
job per write once the table had filled. The gate's ``RUNNING`` CAS and the
completion (:data:`~celery_exactonce.stores.sql.pgwire.BY_KEY`) may keep one
only because the primary key is their one way to the row whatever the
statistics. These tests make the plans on empty, analyzed tables, fill them,
and read what every later run used: the server's scan counters (no timing),
and the plan ``EXPLAIN EXECUTE`` shows of the statement as prepared.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_exactonce.core import jobs
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import Lease, Transition
from celery_exactonce.stores.sql import pgwire
from celery_exactonce.stores.sql.store import SqlStore
from tests import services
from tests.support.backends import store_url
from tests.support.helpers import pooled_driver, task_job, to

FILL = 20_000
PAIRS = 20
_STATES = ("PENDING", "SCHEDULED", "DISPATCHED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED")
_COMPACT = jobs.Compaction(history="none", payload=False)


@pytest.fixture
def tables(tmp_path: Path) -> Iterator[str]:
    """A table prefix of this test's own (dropped after it)."""
    services.need("postgres")
    prefix = f"k{uuid.uuid4().hex[:8]}_"
    yield prefix
    import psycopg

    with psycopg.connect(store_url("postgres", str(tmp_path)), autocommit=True) as conn:
        for name in ("jobs", "leases", "watermarks", "meta", "schema", "skipped"):
            conn.execute(f"DROP TABLE IF EXISTS {prefix}{name}")


def _store(tmp_path: Path, prefix: str, compaction: jobs.Compaction) -> SqlStore:
    url = store_url("postgres", str(tmp_path)).replace("postgresql://", "postgresql+psycopg://")
    store = SqlStore.from_url(
        url,
        namespace=f"n{uuid.uuid4().hex[:8]}",
        retention=3600.0,
        table_prefix=prefix,
        compaction=compaction,
    )
    store.setup()
    store.engine.dispose()  # one connection from now on (one thread): the test reads it
    return store


def _jobs(store: SqlStore, n: int) -> list[JobRef]:
    """``n`` new jobs, ready for the gate."""
    refs = []
    for _ in range(n):
        new = task_job()
        assert store.create(new).created
        refs.append(new.ref)
    return refs


def _run(store: SqlStore, ref: JobRef, lease: Lease | None) -> list[Transition]:
    """``ref`` through the gate and to its end, brief, as a worker runs them."""
    run_id = uuid.uuid4().hex
    guards: dict[str, Any] = {} if lease is None else {"lease": lease}
    gate = to(State.RUNNING, State.SCHEDULED, attempt=0, new_run_id=run_id, **guards)
    done = to(State.SUCCEEDED, State.RUNNING, run_id=run_id, **guards)
    for request in (gate, done):
        (result,) = store.transition_many([(ref, request)], brief=True)
        assert result.applied, result
    return [gate, done]


def _runs_by_key(store: SqlStore, prefix: str, tmp_path: Path, lease: Lease | None) -> None:
    """Run ``PAIRS`` jobs through the gate and to their end: every run found its row by the
    primary key (the jobs made before the count), none read a table."""
    refs = _jobs(store, PAIRS)
    before = _counters(store, prefix, tmp_path)
    for ref in refs:
        _run(store, ref, lease)
    after = _counters(store, prefix, tmp_path)
    delta = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    assert delta[f"seq {prefix}jobs"] == 0, delta
    assert delta[f"{prefix}jobs_pkey"] == 2 * PAIRS, delta
    others = {n: d for n, d in delta.items() if n.startswith(f"{prefix}jobs_") and d}
    assert others == {f"{prefix}jobs_pkey": 2 * PAIRS}, delta
    assert delta.get(f"seq {prefix}leases", 0) == 0, delta
    if lease is not None:
        assert delta[f"{prefix}leases_pkey"] == 2 * PAIRS, delta


def _counters(store: SqlStore, prefix: str, tmp_path: Path) -> dict[str, int]:
    """Sequential scans of the jobs and leases tables, and scans of each of their indexes,
    as the server counts them once the store's connection has reported its own."""
    import psycopg

    with pooled_driver(store) as driver:  # its counts reach the server before this answers
        driver.execute("SELECT pg_stat_force_next_flush()")
        driver.execute("SELECT 1")
    with psycopg.connect(store_url("postgres", str(tmp_path)), autocommit=True) as conn:
        tables = [f"{prefix}jobs", f"{prefix}leases"]
        counts = {
            f"seq {name}": n
            for name, n in conn.execute(
                "SELECT relname, seq_scan FROM pg_stat_user_tables WHERE relname = ANY(%s)",
                [tables],
            )
        }
        counts.update(
            conn.execute(
                "SELECT indexrelname, idx_scan FROM pg_stat_user_indexes WHERE relname = ANY(%s)",
                [tables],
            ).fetchall()
        )
    return counts


def _fill(store: SqlStore, prefix: str, seed: JobRef) -> None:
    """``FILL`` more jobs, copies of ``seed``'s, across states, in its namespace and another."""
    columns = [c.name for c in store._t.jobs.c]
    values = {
        "namespace": "CASE WHEN mod(g, 2) = 0 THEN s.namespace ELSE 'other' END",
        "id": "s.id || '-' || g",
        "state": f"(ARRAY{list(_STATES)!r})[mod(g, {len(_STATES)}) + 1]",
    }
    select = ", ".join(values.get(name, f"s.{name}") for name in columns)
    with pooled_driver(store) as driver:
        driver.execute(
            f"INSERT INTO {prefix}jobs ({', '.join(columns)}) SELECT {select}"
            f" FROM {prefix}jobs s, generate_series(1, {FILL}) g"
            " WHERE s.namespace = %s AND s.space = %s AND s.id = %s",
            [store.namespace, seed.space.value, seed.id],
        )


def _explained(store: SqlStore, ref: JobRef, request: Transition, runs: int) -> str:
    """The plan the kept statement of ``request`` runs on, as the store's connection has it
    (it ran ``runs`` times, each on its generic plan)."""
    from psycopg import sql

    stmt, params = store._sql.transition(store.namespace, ref, request, brief=True)
    form = pgwire.kept(store._raw_sql[stmt][0], pgwire.BY_KEY)
    with pooled_driver(store) as driver:
        plans = driver.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE name = %s",
            [form.name.decode()],
        ).fetchall()
        assert plans == [(runs, 0)], plans
        values = pgwire.values_of(driver, form, params)
        arguments = sql.SQL(", ").join(
            sql.NULL if v is None else sql.Literal(v.decode()) for v in values
        )
        # The settings every run has (a replan is made under them), for the session: a
        # rollback here would let psycopg deallocate every statement prepared
        driver.execute(form.setup.replace(b"true)", b"false)"))
        try:
            query = sql.SQL("EXPLAIN EXECUTE {}({})").format(
                sql.Identifier(form.name.decode()), arguments
            )
            return "\n".join(row[0] for row in driver.execute(query))
        finally:
            driver.execute("RESET enable_seqscan")
            driver.execute("SET plan_cache_mode = force_custom_plan")


@pytest.mark.parametrize("leased", [False, True], ids=["no-lease", "lease"])
@pytest.mark.parametrize("compaction", [jobs.KEEP, _COMPACT], ids=["keep", "compact"])
def test_the_gate_and_the_completion_keep_a_plan_by_the_key_made_on_empty_tables(
    tables: str, tmp_path: Path, leased: bool, compaction: jobs.Compaction
) -> None:
    prefix = tables
    store = _store(tmp_path, prefix, compaction)
    lease = None
    if leased:
        lease = Lease("reconciler", uuid.uuid4().hex)
        assert store.acquire_lease(lease.name, lease.token, 600.0)
    try:
        # Given empty tables, vacuumed and analyzed: statistics of no rows at all
        with pooled_driver(store) as driver:
            driver.execute(f"DELETE FROM {prefix}jobs")
            for table in (f"{prefix}jobs", f"{prefix}leases"):
                # no ANALYZE but the test's (it would make the plans again, filled)
                driver.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
                driver.execute(f"VACUUM ANALYZE {table}")
        # When the gate's CAS and the completion run there first: their plans are made
        (ref,) = _jobs(store, 1)
        requests = _run(store, ref, lease)
        # And the tables then fill: jobs in every state, in this namespace and another
        _fill(store, prefix, ref)
        # Then every later run finds its row by the primary key, none reads the table
        _runs_by_key(store, prefix, tmp_path, lease)
        for request in requests:
            plan = _explained(store, ref, request, 1 + PAIRS)
            assert f"{prefix}jobs_pkey" in plan and "Seq Scan" not in plan, plan
            assert not leased or f"{prefix}leases_pkey" in plan, plan
        # And once the filled tables are analyzed (the plans made again), still by the key
        with pooled_driver(store) as driver:
            driver.execute(f"ANALYZE {prefix}jobs")
            driver.execute(f"ANALYZE {prefix}leases")
        _runs_by_key(store, prefix, tmp_path, lease)
        for request in requests:
            plan = _explained(store, ref, request, 2 + 2 * PAIRS)  # and one EXPLAIN
            assert f"{prefix}jobs_pkey" in plan and "Seq Scan" not in plan, plan
    finally:
        store.close()
