"""A brief batch of transitions on PostgreSQL is one pipeline, each row's CAS unchanged.

Beat's and the dispatcher's ``DISPATCHED`` and ``PUBLISHED`` writes of a chunk
are a brief ``transition_many``; on PostgreSQL the store sends each row's
one-row statement in one psycopg pipeline (``stores/sql/statements_batch.py``).
These tests hold it to the one-row statement's result, row by row: the same
record written, a refused row undoing the batch (then decided one row at a
time), and concurrent batches over the same jobs each applying every job
exactly once, without a deadlock.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from celery_exactonce.core.jobs import TransitionStatus, apply_transition
from celery_exactonce.core.states import State
from celery_exactonce.stores.sql.store import SqlStore
from tests import services
from tests.support.backends import store_url
from tests.support.helpers import task_job, to

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


def _pipelines(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every ``executemany`` psycopg is asked for from now on."""
    calls: list[int] = []
    executemany = psycopg.Cursor.executemany

    def spy(self: psycopg.Cursor[Any], query: Any, params_seq: Any, **kwargs: Any) -> None:
        rows = list(params_seq)
        calls.append(len(rows))
        executemany(self, query, rows, **kwargs)

    monkeypatch.setattr(psycopg.Cursor, "executemany", spy)
    return calls


def _updates(store: SqlStore) -> list[str]:
    """The ``UPDATE``s and savepoint statements ``store`` sends from now on (a list that grows)."""
    sent: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if "UPDATE exactonce_jobs" in statement or "SAVEPOINT" in statement.split()[:3]:
            sent.append(statement)

    sa.event.listen(store.engine, "before_cursor_execute", record)
    return sent


def test_a_brief_batch_is_one_pipeline_that_writes_what_each_cas_would(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a chunk of scheduled jobs
    news = [task_job() for _ in range(CHUNK)]
    store.create_many(news, brief=True)
    listed = [store.get(new.ref) for new in news]
    requests = [(new.ref, to(State.DISPATCHED, State.SCHEDULED, rev=new.rev)) for new in news]
    sent, pipelines = _updates(store), _pipelines(monkeypatch)
    # When the chunk is written DISPATCHED, brief
    results = store.transition_many(requests, brief=True)
    # Then every CAS applied, in one pipeline of the chunk's rows, no UPDATE sent alone
    assert [r.status for r in results] == [TransitionStatus.APPLIED] * CHUNK
    assert pipelines == [CHUNK]
    assert [s.split()[0] for s in sent] == ["SAVEPOINT", "RELEASE"], sent
    # and each record is what apply_transition computes from the listed one
    for job, (ref, request) in zip(listed, requests, strict=True):
        after = store.get(ref)
        assert job is not None and after is not None
        local = apply_transition(job, request, after.touched_at)
        assert after == local


def test_a_refused_row_undoes_the_batch_and_each_row_is_decided_alone(
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
    sent, pipelines = _updates(store), _pipelines(monkeypatch)
    # When the chunk is written DISPATCHED, brief
    results = store.transition_many(requests, brief=True)
    # Then the pipeline ran, was rolled back, and the rows went one at a time
    assert pipelines == [CHUNK]
    assert sent[1].startswith("ROLLBACK TO SAVEPOINT"), sent[:2]
    assert len(sent) == 2 + CHUNK, len(sent)
    # and every answer is the one-row CAS's: the stale one refused with its record, unchanged
    assert [r.status for r in results] == [
        TransitionStatus.CONFLICT if i == stale else TransitionStatus.APPLIED for i in range(CHUNK)
    ]
    refused = store.get(news[stale].ref)
    assert results[stale].job == refused and refused is not None
    assert (refused.state, refused.rev) == (State.SCHEDULED, news[stale].rev)
    assert len(refused.history) == 1
    states = [store.get(new.ref).state for new in news]  # type: ignore[union-attr]
    assert states == [State.SCHEDULED if i == stale else State.DISPATCHED for i in range(CHUNK)]


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
