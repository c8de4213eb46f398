"""The reads gauges are built on (``count_by_state``, ``due_backlog``), on every backend."""

from __future__ import annotations

from datetime import timedelta

from celery_exactonce.core.states import State
from celery_exactonce.stores.base import StateStore
from tests.support.backends import Factory
from tests.support.helpers import NODE, move, occurrence, task_job


def test_counts_follow_every_state_and_move_with_transitions(store: StateStore) -> None:
    empty = store.count_by_state()
    assert empty == dict.fromkeys(State, 0)
    now = store.now()
    store.create(task_job("p", state=State.PENDING, run_at=now + timedelta(hours=1)))
    store.create(task_job("r", state=State.RUNNING))
    created = store.create(task_job("s")).job
    assert created is not None
    store.create(occurrence("tick", now))
    assert store.count_by_state() == {
        **dict.fromkeys(State, 0),
        State.PENDING: 1,
        State.SCHEDULED: 2,
        State.RUNNING: 1,
    }
    dispatched = move(store, created, State.DISPATCHED)
    move(store, dispatched, State.PUBLISHED)
    counts = store.count_by_state()
    assert (counts[State.SCHEDULED], counts[State.DISPATCHED], counts[State.PUBLISHED]) == (1, 0, 1)
    assert sum(counts.values()) == 4


def test_counts_are_per_namespace(store_factory: Factory) -> None:
    mine, other = store_factory(), store_factory(namespace=f"{store_factory().namespace}-x")
    other.create(task_job("theirs"))
    assert sum(mine.count_by_state().values()) == 0
    assert other.count_by_state()[State.SCHEDULED] == 1


def test_due_backlog_counts_due_pending_jobs_and_the_oldest(store: StateStore) -> None:
    empty = store.due_backlog()
    assert (empty.count, empty.oldest, empty.oldest_age) == (0, None, 0.0)
    now = store.now()
    oldest = now - timedelta(minutes=5)
    store.create(task_job("old", state=State.PENDING, run_at=oldest))
    store.create(task_job("recent", state=State.PENDING, run_at=now - timedelta(seconds=1)))
    store.create(task_job("future", state=State.PENDING, run_at=now + timedelta(hours=1)))
    store.create(task_job("not-pending"))  # SCHEDULED: claimed, not in the backlog
    backlog = store.due_backlog()
    assert backlog.count == 2
    assert backlog.oldest == oldest
    assert now <= backlog.now <= store.now()
    assert 300 <= backlog.oldest_age < 360
    claimed = store.claim_due(1, node=NODE)
    assert [job.ref.id for job in claimed] == ["old"]
    after = store.due_backlog()
    assert (after.count, after.oldest) == (1, now - timedelta(seconds=1))
