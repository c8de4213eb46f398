"""Unique creates: a live job holds its key, an ended one frees it; the same bodies on every store.

A store that keeps no unique keys (a sharded Redis) refuses, naming the
setting, and writes nothing.
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from datetime import datetime, timedelta, timezone

import pytest

from celery_exactonce.core import exceptions
from celery_exactonce.core.jobs import CreateResult, CreateStatus
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import UNIQUE_OPTION, NewJob
from celery_exactonce.stores import settle
from celery_exactonce.stores.base import StateStore
from celery_exactonce.stores.unique import keeps_unique
from tests.support.backends import CLUSTER
from tests.support.helpers import move, task_job

#: How many threads race for one key, each with jobs of its own.
RACERS, TRIES = 8, 15


def unique_job(
    key: str,
    job_id: str | None = None,
    state: State = State.SCHEDULED,
    run_at: datetime | None = None,
) -> NewJob:
    new = task_job(job_id, state, run_at=run_at)
    return dataclasses.replace(new, options={**new.options, UNIQUE_OPTION: key})


@pytest.fixture
def unique_store(store: StateStore, backend: str) -> StateStore:
    if not keeps_unique(store):
        assert backend in CLUSTER, f"{backend} keeps no unique keys"
        pytest.skip(f"{backend} keeps no unique keys (refused: test_a_sharded_store_refuses)")
    return store


def create(store: StateStore, new: NewJob) -> CreateResult:
    return store.create_unique(new)  # type: ignore[attr-defined, no-any-return]


def test_a_live_job_holds_its_key(unique_store: StateStore) -> None:
    key = f"u:{uuid.uuid4().hex}"
    first = unique_job(key)
    assert create(unique_store, first).status is CreateStatus.CREATED
    second = unique_job(key)
    held = create(unique_store, second)
    assert held.status is CreateStatus.UNIQUE_HELD
    assert held.job is not None and held.job.ref == first.ref
    assert unique_store.get(second.ref) is None  # nothing written
    other = unique_job(f"u:{uuid.uuid4().hex}")
    assert create(unique_store, other).created  # another key is another job


def test_the_key_is_held_in_every_live_state_and_freed_by_the_end(
    unique_store: StateStore,
) -> None:
    key = f"u:{uuid.uuid4().hex}"
    holder = create(
        unique_store,
        unique_job(
            key, state=State.PENDING, run_at=datetime.now(timezone.utc) + timedelta(hours=1)
        ),
    ).job
    assert holder is not None and holder.state is State.PENDING
    for state in (State.SCHEDULED, State.DISPATCHED, State.RUNNING):
        holder = move(unique_store, holder, state)
        assert create(unique_store, unique_job(key)).status is CreateStatus.UNIQUE_HELD, state
    move(unique_store, holder, State.SUCCEEDED)
    after = unique_job(key)
    assert create(unique_store, after).created  # ended: the next one is a new job
    held = create(unique_store, unique_job(key))
    assert held.status is CreateStatus.UNIQUE_HELD
    assert held.job is not None and held.job.ref == after.ref


def test_a_repeated_unique_create_answers_as_a_repeated_create(unique_store: StateStore) -> None:
    new = unique_job(f"u:{uuid.uuid4().hex}")
    assert create(unique_store, new).created
    again = create(unique_store, new)
    assert again.status is CreateStatus.EXISTS
    assert again.job is not None and again.job.rev == new.rev
    move(unique_store, unique_store.get(new.ref), State.CANCELLED)  # type: ignore[arg-type]
    taker = unique_job(new.unique or "")
    assert create(unique_store, taker).created
    again = create(unique_store, new)  # its own id again, ended, another holds the key now
    assert again.status is CreateStatus.EXISTS
    assert again.job is not None and again.job.ref == new.ref
    plain = task_job()  # an id taken without a key: EXISTS, the key stays free
    assert unique_store.create(plain).created
    clash = dataclasses.replace(unique_job(f"u:{uuid.uuid4().hex}"), ref=plain.ref)
    assert create(unique_store, clash).status is CreateStatus.EXISTS


def test_racers_for_one_key_create_one_job(unique_store: StateStore, store_factory: object) -> None:
    key = f"u:{uuid.uuid4().hex}"
    barrier = threading.Barrier(RACERS)
    created: list[str] = []
    holders: set[str] = set()
    errors: list[BaseException] = []

    def race() -> None:
        store = store_factory()  # type: ignore[operator]  # a client of its own
        try:
            barrier.wait(timeout=60)
            for _ in range(TRIES):
                new = unique_job(key)
                result = store.create_unique(new)
                if result.created:
                    created.append(new.ref.id)
                else:
                    assert result.status is CreateStatus.UNIQUE_HELD, result.status
                    holders.add(result.job.ref.id)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=race) for _ in range(RACERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert len(created) == 1, created
    assert holders == set(created)


def test_a_sharded_store_refuses(store: StateStore, backend: str) -> None:
    if keeps_unique(store):
        assert backend not in CLUSTER
        return
    new = unique_job(f"u:{uuid.uuid4().hex}")
    with pytest.raises(exceptions.ConfigurationError, match="exactonce_unique"):
        settle.create_unique(store, new)
    assert store.get(new.ref) is None
