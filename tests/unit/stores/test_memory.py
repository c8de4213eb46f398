"""InMemoryStore with a FrozenClock: time-dependent rules without sleeping."""

from __future__ import annotations

from datetime import timedelta

import pytest

from celery_exactonce import StoreError
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import Lease, NewJob, Transition
from celery_exactonce.stores.base import StateStore
from celery_exactonce.testing import FrozenClock, InMemoryStore

NODE = "n"


@pytest.fixture
def clock() -> FrozenClock:
    return FrozenClock()


@pytest.fixture
def store(clock: FrozenClock) -> InMemoryStore:
    return InMemoryStore("unit", retention=3600, clock=clock)


def test_satisfies_the_protocol(store: InMemoryStore) -> None:
    typed: StateStore = store
    assert isinstance(typed, StateStore)


def test_store_time_is_the_injected_clock(store: InMemoryStore, clock: FrozenClock) -> None:
    assert store.now() == clock.now()
    clock.advance(90)
    assert store.now() == clock.now()


def test_due_and_stale_by_store_time(store: InMemoryStore, clock: FrozenClock) -> None:
    store.create(
        NewJob(
            JobRef.submitted("d"),
            "t",
            State.PENDING,
            node=NODE,
            run_at=clock.now() + timedelta(seconds=60),
        )
    )
    assert store.claim_due(10, node=NODE) == []
    clock.advance(59.999999)
    assert store.claim_due(10, node=NODE) == []
    clock.advance(0.000001)
    (job,) = store.claim_due(10, node=NODE)
    assert store.list_stale(State.SCHEDULED, 30, 10) == []
    clock.advance(30)
    assert [j.ref for j in store.list_stale(State.SCHEDULED, 30, 10)] == [job.ref]


def test_running_timeout_needs_a_stale_heartbeat(store: InMemoryStore, clock: FrozenClock) -> None:
    store.create(NewJob(JobRef.submitted("r"), "t", State.RUNNING, node=NODE, run_id="run"))
    timeout = Transition(
        State.TIMEOUT, frozenset({State.RUNNING}), node=NODE, reason="stale", stale_for=600
    )
    clock.advance(599)
    assert store.heartbeat(JobRef.submitted("r"), "run")
    clock.advance(599)
    assert not store.transition(JobRef.submitted("r"), timeout).applied
    clock.advance(1)
    assert store.transition(JobRef.submitted("r"), timeout).applied


def test_a_clock_stepping_back_expires_nothing(store: InMemoryStore, clock: FrozenClock) -> None:
    assert store.acquire_lease("l", "a", 10)
    clock.set(clock.now() - timedelta(seconds=60))
    assert not store.acquire_lease("l", "b", 10)
    clock.advance(71)
    assert store.acquire_lease("l", "b", 10)
    transition = Transition(
        State.CANCELLED, frozenset({State.SCHEDULED}), node=NODE, reason="x", lease=Lease("l", "a")
    )
    store.create(NewJob(JobRef.submitted("j"), "t", State.SCHEDULED, node=NODE))
    assert store.transition(JobRef.submitted("j"), transition).status.value == "lease_lost"


def test_expiry_counts_from_the_later_of_fire_time_and_terminal(clock: FrozenClock) -> None:
    store = InMemoryStore("unit", retention=86_400, clock=clock)
    fire = clock.now() + timedelta(days=2)
    ref = JobRef.occurrence("monthly@x")
    store.create(NewJob(ref, "t", State.SCHEDULED, node=NODE, entry="monthly", fire_time=fire))
    store.transition(
        ref, Transition(State.CANCELLED, frozenset({State.SCHEDULED}), node=NODE, reason="x")
    )
    clock.advance(days=2, seconds=86_399)
    assert store.purge_expired(10) == 0
    clock.advance(1)
    assert store.purge_expired(10) == 1
    assert store.get(ref) is None


def test_closed_store_refuses_work(store: InMemoryStore) -> None:
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.get(JobRef.submitted("x"))
