"""A terminal record as the settings keep it (``exactonce_terminal_history``/``_payload``).

On every store: what a compacted terminal record still says (state, reason,
node, times, attempt, run id, key), what it no longer holds, and that every
operation on terminal records still works on it: reads, listings, counts,
annotations, refused transitions, expiry.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from celery_exactonce.core.jobs import Compaction, CreateStatus, Job
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.stores.base import StateStore
from tests.support.backends import StoreFactory
from tests.support.helpers import move, occurrence, poll, task_job, to

COMPACT = Compaction(history="none", payload=False)


def _run(store: StateStore, new: NewJob) -> tuple[Job, Job]:
    """``new`` created, dispatched, run and succeeded: the record while running, and at the end."""
    created = store.create(new).job
    assert created is not None
    running = move(store, move(store, created, State.DISPATCHED), State.RUNNING)
    return running, move(store, running, State.SUCCEEDED)


def test_a_compacted_terminal_record_keeps_what_operators_read(
    store_factory: StoreFactory,
) -> None:
    store = store_factory(compaction=COMPACT)
    new = task_job("compact-1", kwargs={"k": "v" * 100})
    running, done = _run(store, new)
    # Then the answer of the terminal write and the record read back agree
    got = store.get(new.ref)
    assert got == done
    assert got is not None
    # And it says what ended the job, when, where, and after how many attempts
    assert (got.ref, got.task, got.state, got.reason, got.node) == (
        new.ref,
        new.task,
        State.SUCCEEDED,
        "test",
        "n",
    )
    assert (got.attempt, got.run_id, got.dispatches) == (0, running.run_id, 1)
    assert got.created_at == running.created_at and got.terminal_at == got.touched_at
    assert got.terminal_at is not None and got.terminal_at >= running.touched_at
    # But holds no history and no payload
    assert (got.history, got.args, got.kwargs, got.options) == ((), [], {}, {})
    # And is listed, counted and found like any other
    assert [j.ref for j in store.list_stale(State.SUCCEEDED, 0, 10)] == [new.ref]
    assert store.count_by_state()[State.SUCCEEDED] == 1


def test_a_live_record_keeps_everything_until_it_ends(store_factory: StoreFactory) -> None:
    store = store_factory(compaction=COMPACT)
    new = task_job("compact-live", args=(1, 2))
    running, _ = _run(store, new)
    assert running.args == [1, 2] and len(running.history) == 3


def test_the_last_entry_is_kept_when_asked(store_factory: StoreFactory) -> None:
    store = store_factory(compaction=Compaction(history="last"))
    new = task_job("compact-last", args=(7,))
    _, done = _run(store, new)
    got = store.get(new.ref)
    assert got == done and got is not None
    (entry,) = got.history
    assert (entry.src, entry.dst, entry.rev, entry.at) == (
        State.RUNNING,
        State.SUCCEEDED,
        got.rev,
        got.terminal_at,
    )
    assert got.args == [7]  # the payload is kept: only the history was asked to go
    assert got.applied(got.rev)


def test_a_compacted_record_answers_late_writers(store_factory: StoreFactory) -> None:
    store = store_factory(compaction=COMPACT)
    fire = store.now()
    new = occurrence("compact-e", fire)
    created = store.create(new).job
    assert created is not None
    done = move(store, move(store, created, State.DISPATCHED), State.PUBLISHED)
    # A late transition is refused with the record, its ref included
    refused = store.transition(new.ref, to(State.DISPATCHED, State.SCHEDULED))
    assert not refused.applied and refused.job == done
    # A claim of the same slot finds it
    again = store.create(new)
    assert not again.created and again.job is not None and again.job.ref == new.ref
    assert (again.job.entry, again.job.fire_time) == (new.entry, fire)
    # A note is kept, once
    assert store.annotate(new.ref, node="late", reason="late outcome", op_id="op-1")
    assert store.annotate(new.ref, node="late", reason="late outcome", op_id="op-1")
    noted = store.get(new.ref)
    assert noted is not None and [h.rev for h in noted.history] == ["op-1"]
    assert noted.state is State.PUBLISHED and noted.rev == done.rev


@pytest.mark.parametrize("compaction", [COMPACT, Compaction()], ids=["compact", "full"])
def test_compacted_records_expire(store_factory: StoreFactory, compaction: Compaction) -> None:
    store = store_factory(retention=0.05, compaction=compaction)
    refs, last = [], None
    for i in range(3):
        new = task_job(f"compact-x{i}")
        last = _run(store, new)[1]
        refs.append(new.ref)
    assert last is not None and last.terminal_at is not None
    end = last.terminal_at + timedelta(seconds=0.06)
    poll(lambda: store.now() >= end)
    assert store.purge_expired(2) == 2
    assert store.purge_expired(10) == 1
    assert store.purge_expired(10) == 0
    assert [store.get(ref) for ref in refs] == [None, None, None]
    assert store.count_by_state()[State.SUCCEEDED] == 0


def test_an_occurrence_may_go_before_the_retention_and_its_slot_stays_decided(
    store_factory: StoreFactory,
) -> None:
    # Given occurrences kept 0.05 s once terminal, every other record an hour
    store = store_factory(compaction=Compaction(occurrence_retention=0.05))
    fire = store.now() - timedelta(seconds=1)
    new, job = occurrence("short-e", fire), task_job("short-t")
    for created in (store.create(new).job, store.create(job).job):
        assert created is not None
        move(store, move(store, created, State.DISPATCHED), State.PUBLISHED)
    done = store.get(new.ref)
    assert done is not None and done.terminal_at is not None
    # When its retention has passed, the occurrence is purged, the other record kept
    end = done.terminal_at + timedelta(seconds=0.06)
    poll(lambda: store.now() >= end)
    assert store.purge_expired(10) == 1
    assert store.get(new.ref) is None and store.get(job.ref) is not None
    # And its slot is still decided: the entry's watermark refuses a claim of it
    again = store.create(occurrence("short-e", fire))
    assert again.status is CreateStatus.BELOW_WATERMARK and store.get(new.ref) is None
    assert store.watermark("short-e") == fire
