"""Beat's batches on PostgreSQL are one statement each, every row decided as its own would be.

A batch of beat's claims (``create_many``, brief) is one ``INSERT`` of every
claim, and the ``DISPATCHED`` and ``PUBLISHED`` writes of a chunk (a brief
``transition_many``) one ``UPDATE`` of every job
(``stores/sql/statements_batch.py``). These tests hold each to the one-row
statement's result, row by row: the same record written, the same answers
(``EXISTS``, ``BELOW_WATERMARK``, another epoch), a refused row decided alone
afterwards, concurrent batches over the same jobs each applying every job
exactly once without a deadlock, and a plan that finds every row by its key
however many jobs the namespace holds.
"""

from __future__ import annotations

import re
import threading
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from celery_exactonce.core.jobs import (
    CreateStatus,
    TransitionStatus,
    apply_transition,
    job_from_new,
)
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import Lease
from celery_exactonce.stores.sql import engine as sql_engine
from celery_exactonce.stores.sql import pgwire
from celery_exactonce.stores.sql.store import SqlStore
from tests import services
from tests.support.backends import store_url
from tests.support.helpers import occurrence, task_job, to

#: Jobs of a batch: a dispatcher's chunk.
CHUNK = 32


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqlStore]:
    services.need("postgres")
    url = store_url("postgres", str(tmp_path)).replace("postgresql://", "postgresql+psycopg://")
    store = SqlStore.from_url(url, namespace=f"t{uuid.uuid4().hex[:12]}", retention=3600.0)
    store.setup()
    yield store
    store.drop_namespace()
    store.close()


def _sent(store: SqlStore, word: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The statements with ``word`` (or a savepoint's) ``store`` sends from now on (a list that
    grows), through SQLAlchemy or on the driver (a statement run alone)."""
    sent: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if word in statement or "SAVEPOINT" in statement.split()[:3]:
            sent.append(statement)

    def alone(driver: Any, statement: str, *args: Any, **kwargs: Any) -> Any:
        record(None, None, statement)
        return execute(driver, statement, *args, **kwargs)

    sa.event.listen(store.engine, "before_cursor_execute", record)
    execute = sql_engine.execute
    monkeypatch.setattr(sql_engine, "execute", alone)
    return sent


def test_a_brief_batch_is_one_statement_that_writes_what_each_cas_would(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a chunk of scheduled jobs
    news = [task_job() for _ in range(CHUNK)]
    store.create_many(news, brief=True)
    listed = [store.get(new.ref) for new in news]
    requests = [(new.ref, to(State.DISPATCHED, State.SCHEDULED, rev=new.rev)) for new in news]
    sent = _sent(store, "UPDATE exactonce_jobs", monkeypatch)
    # When the chunk is written DISPATCHED, brief
    results = store.transition_many(requests, brief=True)
    # Then every CAS applied, by one statement of the whole chunk, in autocommit
    assert [r.status for r in results] == [TransitionStatus.APPLIED] * CHUNK
    assert len(sent) == 1 and "unnest" in sent[0], sent
    # and each record is what apply_transition computes from the listed one
    for job, (ref, request) in zip(listed, requests, strict=True):
        after = store.get(ref)
        assert job is not None and after is not None
        local = apply_transition(job, request, after.touched_at)
        assert after == local


def test_a_refused_row_is_decided_alone_and_the_applied_ones_are_not_written_again(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a chunk where one job's listed rev is stale
    news = [task_job() for _ in range(CHUNK)]
    store.create_many(news, brief=True)
    stale = 7
    requests = [
        (new.ref, to(State.DISPATCHED, State.SCHEDULED, rev="stale" if i == stale else new.rev))
        for i, new in enumerate(news)
    ]
    sent = _sent(store, "UPDATE exactonce_jobs", monkeypatch)
    locked = _sent(store, "FOR UPDATE", monkeypatch)
    # When the chunk is written DISPATCHED, brief
    results = store.transition_many(requests, brief=True)
    # Then the batch's statement ran once, and only the refused row was decided again, alone,
    # the locking way (its statement is not sent twice)
    assert len(sent) == 1 and "unnest" in sent[0], sent
    assert len(locked) == 1 and "unnest" not in locked[0], locked
    # and every answer is the one-row CAS's: the stale one refused with its record, unchanged
    assert [r.status for r in results] == [
        TransitionStatus.CONFLICT if i == stale else TransitionStatus.APPLIED for i in range(CHUNK)
    ]
    refused = store.get(news[stale].ref)
    assert results[stale].job == refused and refused is not None
    assert (refused.state, refused.rev) == (State.SCHEDULED, news[stale].rev)
    assert len(refused.history) == 1
    jobs = [store.get(new.ref) for new in news]
    assert [(j.state, len(j.history)) for j in jobs if j is not None] == [
        (State.SCHEDULED, 1) if i == stale else (State.DISPATCHED, 2) for i in range(CHUNK)
    ]


def test_a_batch_in_a_transaction_of_its_own_is_undone_when_a_row_is_refused(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a store that does not own its transactions (the django:// store's way)
    monkeypatch.setattr(SqlStore, "owns_transactions", False)
    news = [task_job() for _ in range(CHUNK)]
    store.create_many(news, brief=True)
    requests = [
        (new.ref, to(State.DISPATCHED, State.SCHEDULED, rev="stale" if i == 0 else new.rev))
        for i, new in enumerate(news)
    ]
    sent = _sent(store, "UPDATE exactonce_jobs", monkeypatch)
    # When the chunk with one stale rev is written DISPATCHED, brief
    results = store.transition_many(requests, brief=True)
    # Then the statement ran under a savepoint, was rolled back, and the rows went one at a time
    assert [s.split()[0] for s in sent[:3]] == ["SAVEPOINT", "WITH", "ROLLBACK"], sent[:3]
    assert len(sent) == 3 + CHUNK, len(sent)
    assert [r.status for r in results] == [TransitionStatus.CONFLICT] + [
        TransitionStatus.APPLIED
    ] * (CHUNK - 1)
    assert all(len(j.history) == 2 for j in map(store.get, [n.ref for n in news[1:]]) if j)


def _slot(k: int = 0) -> datetime:
    return datetime(2030, 1, 1, tzinfo=timezone.utc) + timedelta(minutes=k)


def test_a_batch_of_claims_is_one_statement_that_writes_what_each_create_would(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a beat batch: one slot of many entries, and the same claim created alone
    epoch = store.epoch()
    alone = store.create(occurrence("alone", _slot()), epoch=epoch)
    news = [occurrence(f"e{i:03}", _slot()) for i in range(CHUNK)]
    sent = _sent(store, "INSERT INTO exactonce_jobs", monkeypatch)
    # When the batch is claimed
    results = store.create_many(news, epoch=epoch, brief=True)
    # Then one statement created every record and advanced every mark
    assert len(sent) == 1 and "unnest" in sent[0], sent
    assert [r.status for r in results] == [CreateStatus.CREATED] * CHUNK
    assert store.watermarks([n.entry for n in news if n.entry]) == {
        f"e{i:03}": _slot() for i in range(CHUNK)
    }
    # and each record is the one a create of it alone writes (its clock aside)
    assert alone.job is not None
    for new, result in zip(news, results, strict=True):
        stored = store.get(new.ref)
        assert stored is not None and result.job == stored
        assert stored == job_from_new(new, stored.created_at)
        assert stored.created_at >= alone.job.created_at


def test_a_batch_of_claims_answers_what_each_create_would(store: SqlStore) -> None:
    # Given entries whose slot is claimed, entries whose mark is past the slot, fresh ones
    epoch = store.epoch()
    store.create_many([occurrence(f"e{i:03}", _slot(1)) for i in range(0, 10)], brief=True)
    store.create_many([occurrence(f"e{i:03}", _slot(2)) for i in range(10, 20)], brief=True)
    news = [occurrence(f"e{i:03}", _slot(1)) for i in range(30)]
    # When the slot is claimed as a batch, after another epoch and then under the stored one
    refused = store.create_many(news, epoch="another", brief=True)
    results = store.create_many(news, epoch=epoch, brief=False)
    # Then another epoch is refused whole, and each claim has the answer a create gives it
    assert {r.status for r in refused} == {CreateStatus.EPOCH_MISMATCH}
    assert [r.status for r in results] == (
        [CreateStatus.EXISTS] * 10
        + [CreateStatus.BELOW_WATERMARK] * 10
        + [CreateStatus.CREATED] * 10
    )
    assert all(r.job == store.get(n.ref) for r, n in zip(results[:10], news, strict=False))
    assert [store.get(n.ref) is None for n in news[10:20]] == [True] * 10


def test_a_batch_with_an_entry_twice_is_claimed_one_row_at_a_time(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a catch-up batch: two slots of one entry, beside other entries
    news = [occurrence("a", _slot(1)), occurrence("a", _slot(2)), occurrence("b", _slot(1))]
    sent = _sent(store, "INSERT INTO exactonce_jobs", monkeypatch)
    # When it is claimed
    results = store.create_many(news, brief=True)
    # Then each slot was created by its own statement, and the entry's mark is its newest slot
    assert [r.status for r in results] == [CreateStatus.CREATED] * 3
    assert len(sent) == 3 and not any("unnest" in s for s in sent), sent
    assert store.watermarks(["a", "b"]) == {"a": _slot(2), "b": _slot(1)}


def _scans(plan: Any) -> list[dict[str, Any]]:
    """Every scan of the jobs table in a plan (``EXPLAIN (FORMAT JSON)``)."""
    found = []
    if isinstance(plan, dict):
        if plan.get("Relation Name") == "exactonce_jobs" and "Scan" in plan.get("Node Type", ""):
            found.append(plan)
        for value in plan.values():
            found += _scans(value)
    elif isinstance(plan, list):
        for value in plan:
            found += _scans(value)
    return found


def test_the_batches_find_each_row_by_its_key_in_a_namespace_of_many_jobs(
    store: SqlStore,
) -> None:
    # Given a namespace of 3,000 jobs, and a claims batch, its decided read and a transitions
    # batch over it
    news = [task_job() for _ in range(3000)]
    for start in range(0, len(news), 500):
        store.create_many(news[start : start + 500], brief=True)
    chunk = sorted(news[1000 : 1000 + CHUNK], key=lambda n: str(n.ref))
    batches = {
        "claims": store._sql.create_batch(
            store.namespace, [occurrence(f"e{i}", _slot()) for i in range(CHUNK)], None
        ),
        "transitions": store._sql.transition_batch(
            store.namespace, [(n.ref, to(State.DISPATCHED, State.SCHEDULED)) for n in chunk]
        ),
        "decided": store._sql.decided(
            store.namespace, [f"e{i}" for i in range(CHUNK)], [n.ref.id for n in chunk]
        ),
    }
    for name, batch in batches.items():
        assert batch is not None
        stmt, params = batch
        # When PostgreSQL plans it (as it runs: a plan of its own)
        with store.engine.connect() as conn:
            explain = sa.text(f"EXPLAIN (FORMAT JSON) {stmt.compile(dialect=store.engine.dialect)}")
            raw = conn.connection.driver_connection
            with raw.cursor() as cursor:  # type: ignore[union-attr]
                cursor.execute(str(explain), params)
                plan = cursor.fetchone()[0]
            conn.rollback()
        # Then every read of the jobs table goes by the key of one row: its id, or its place
        scans = _scans(plan)
        assert scans, name
        for scan in scans:
            by_key = scan["Node Type"] in ("Index Scan", "Index Only Scan") and bool(
                re.search(r"\(?\bid\)?(::text)? = ", scan.get("Index Cond", ""))
            )
            assert by_key or scan["Node Type"] == "Tid Scan", (name, scan)


def test_concurrent_batches_apply_each_job_once_without_a_deadlock(store: SqlStore) -> None:
    # Given jobs that several writers race to move, each with its own batch of them all
    news = [task_job() for _ in range(CHUNK)]
    store.create_many(news, brief=True)
    writers = 4
    outcomes: list[list[TransitionStatus]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(writers)

    def write(k: int) -> None:
        # each writer lists the jobs in its own order; the store sorts them by key
        order = news[k:] + news[:k]
        requests = [(new.ref, to(State.DISPATCHED, State.SCHEDULED)) for new in order]
        try:
            start.wait(timeout=10)
            results = store.transition_many(requests, brief=True)
            outcomes.append([r.status for r in results[CHUNK - k :] + results[: CHUNK - k]])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(k,)) for k in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    # Then every writer ended, none failed
    assert not any(thread.is_alive() for thread in threads)
    assert not errors, errors
    # and each job was moved exactly once, by one writer; the others were refused
    for i, new in enumerate(news):
        statuses = [outcome[i] for outcome in outcomes]
        assert statuses.count(TransitionStatus.APPLIED) == 1, (new.ref, statuses)
        assert statuses.count(TransitionStatus.CONFLICT) == writers - 1
        job = store.get(new.ref)
        assert job is not None and (job.state, job.dispatches) == (State.DISPATCHED, 1)


@pytest.mark.parametrize("size", [1, CHUNK])
def test_a_brief_write_under_a_lease_runs_alone_on_the_driver(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    # Given jobs, and a lease the writer holds
    news = [task_job() for _ in range(size)]
    store.create_many(news, brief=True)
    assert store.acquire_lease("effects", "tok", 60.0)
    lease = Lease("effects", "tok")
    sent = _sent(store, "UPDATE exactonce_jobs", monkeypatch)
    autocommit: list[bool] = []
    execute = sql_engine.execute

    def alone(driver: Any, *args: Any, **kwargs: Any) -> Any:
        autocommit.append(driver.autocommit)
        return execute(driver, *args, **kwargs)

    monkeypatch.setattr(sql_engine, "execute", alone)
    # When they are written DISPATCHED under it, brief (one, as the gate writes, or a chunk)
    requests = [(new.ref, to(State.DISPATCHED, State.SCHEDULED, lease=lease)) for new in news]
    results = store.transition_many(requests, brief=True)
    # Then one statement applied them all, alone on the driver in autocommit
    assert [r.status for r in results] == [TransitionStatus.APPLIED] * size
    assert len(sent) == 1 and ("unnest" in sent[0]) == (size > 1), sent
    assert autocommit == [True]
    assert [store.get(new.ref).state for new in news] == [State.DISPATCHED] * size  # type: ignore[union-attr]


@pytest.mark.parametrize("size", [1, CHUNK])
def test_a_deadlocked_statement_alone_leaves_every_row_to_the_locking_transaction(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    # Given jobs, and a statement alone that fails as a deadlock victim's does (rolled back)
    news = [task_job() for _ in range(size)]
    store.create_many(news, brief=True)
    locked = _sent(store, "FOR UPDATE", monkeypatch)
    alone: list[str] = []

    def deadlocked(_driver: Any, statement: str, *_args: Any, **_kwargs: Any) -> Any:
        alone.append(statement)
        raise psycopg.errors.DeadlockDetected("deadlock detected")

    monkeypatch.setattr(sql_engine, "execute", deadlocked)
    # When they are written DISPATCHED, brief
    requests = [(new.ref, to(State.DISPATCHED, State.SCHEDULED)) for new in news]
    results = store.transition_many(requests, brief=True)
    # Then the statement ran once, and every row was decided the locking way, and applied
    assert len(alone) == 1
    assert len(locked) == size
    assert [r.status for r in results] == [TransitionStatus.APPLIED] * size
    jobs = [store.get(new.ref) for new in news]
    assert [(j.state, j.dispatches) for j in jobs if j] == [(State.DISPATCHED, 1)] * size


def test_a_brief_batch_of_two_shapes_writes_each_row_by_its_own_statement(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given two jobs whose writes are not one statement (one guarded by its rev, one not)
    news = [task_job(), task_job()]
    store.create_many(news, brief=True)
    sent = _sent(store, "UPDATE exactonce_jobs", monkeypatch)
    locked = _sent(store, "FOR UPDATE", monkeypatch)
    together: list[int] = []
    run_kept_many = pgwire.run_kept_many

    def counted(driver: Any, items: Any, *args: Any) -> Any:
        together.append(len(items))
        return run_kept_many(driver, items, *args)

    monkeypatch.setattr(pgwire, "run_kept_many", counted)
    # When both are written DISPATCHED in one brief call
    requests = [
        (news[0].ref, to(State.DISPATCHED, State.SCHEDULED, rev=news[0].rev)),
        (news[1].ref, to(State.DISPATCHED, State.SCHEDULED)),
    ]
    results = store.transition_many(requests, brief=True)
    # Then each went by its one-row statement, none the locking way: on PostgreSQL
    # both in one message (each on its kept plan), elsewhere one after the other
    assert [r.status for r in results] == [TransitionStatus.APPLIED] * 2
    if store.engine.dialect.name == "postgresql":
        assert together == [2] and sent == [], (together, sent)
    else:
        assert len(sent) == 2 and not any("unnest" in s for s in sent), sent
    assert locked == []
