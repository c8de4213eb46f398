"""Races: many creators and claimers, in threads and in processes, on every store.

The memory store lives in one process, so there the racers are threads only;
every other backend gets threads spread over several spawned processes.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest

from celery_exactonce.core.states import State
from celery_exactonce.stores.base import StateStore
from tests.contract.racers import run_threads
from tests.support.backends import DJANGO_BACKENDS, StoreFactory
from tests.support.helpers import task_job

pytestmark = pytest.mark.race

#: Jobs in the claim race; the acceptance figure is 10,000 (override to go faster locally).
CLAIM_JOBS = int(os.environ.get("EXACTONCE_RACE_CLAIM_JOBS", "10000"))
CREATE_JOBS = int(os.environ.get("EXACTONCE_RACE_CREATE_JOBS", "1000"))


def race(
    factory: StoreFactory, racer: str, args: list[tuple[Any, ...]], processes: int
) -> list[list[str]]:
    """Run the racers, split over ``processes`` spawned processes (threads only for memory)."""
    if factory.backend == "memory" or processes == 1:
        stores = [factory() for _ in args]
        return run_threads(racer, stores, threading.Barrier(len(args)), args)
    from tests.contract.racers import process_main

    # A store made here, so that the factory's cleanup drops the namespace the processes
    # wrote (it drops the namespaces of the stores it made).
    factory()
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        barrier = manager.Barrier(processes)
        chunks = [args[i::processes] for i in range(processes)]
        with ProcessPoolExecutor(processes, mp_context=context) as pool:
            futures = [
                pool.submit(
                    process_main,
                    racer,
                    factory.backend,
                    factory.url,
                    factory.namespace,
                    barrier,
                    chunk,
                )
                for chunk in chunks
            ]
            return [result for f in futures for result in f.result(timeout=900)]


#: Backends whose two longest races run under -m slow (tox -e chaos) only: the Django
#: store is the SQL store on Django's connection, and SQLite holds one host's processes
#: (the races of PostgreSQL and MySQL, the stores of many nodes, run by default). Their
#: shorter races below run by default.
LONG_RACES_SLOW_ON = (*DJANGO_BACKENDS, "sqlite")


@pytest.mark.slow_backends(*LONG_RACES_SLOW_ON)
def test_sixteen_creators_one_creator_per_job(store_factory: StoreFactory) -> None:
    # Given 1,000 job ids and 16 creators (8 threads in each of 2 processes)
    ids = [f"job-{i}" for i in range(CREATE_JOBS)]
    # When every creator creates every id, each in its own order
    results = race(store_factory, "create", [(ids, seed) for seed in range(16)], processes=2)
    # Then each job had exactly one creator
    created = collections.Counter(job_id for result in results for job_id in result)
    assert sorted(created) == sorted(ids)
    assert set(created.values()) == {1}
    assert sum(len(r) > 0 for r in results) > 1  # the race was real: several creators won some


def test_sixteen_beat_nodes_one_claim_per_slot(store_factory: StoreFactory) -> None:
    store = store_factory()
    start = store.now().replace(microsecond=0)
    slots = [start + timedelta(seconds=i) for i in range(100)]
    results = race(store_factory, "slots", [("entry", slots)] * 16, processes=2)
    won = collections.Counter(fire for result in results for fire in result)
    assert sorted(won) == sorted(fire.isoformat() for fire in slots)
    assert set(won.values()) == {1}
    assert store.watermark("entry") == slots[-1]


def test_eight_batching_beat_nodes_one_claim_per_slot(store_factory: StoreFactory) -> None:
    # Given 8 beat nodes (4 threads in each of 2 processes) and 10 entries x 20 slots
    store = store_factory()
    start = store.now().replace(microsecond=0)
    slots = [start + timedelta(seconds=i) for i in range(20)]
    entries = [f"entry-{i}" for i in range(10)]
    # When each claims them all in batches (create_many), entries in its own order
    args = [(entries, slots, seed) for seed in range(8)]
    results = race(store_factory, "slot_batches", args, processes=2)
    # Then every occurrence was won exactly once, and no batch deadlocked
    won = collections.Counter(job_id for result in results for job_id in result)
    assert len(won) == len(entries) * len(slots)
    assert set(won.values()) == {1}
    assert all(store.watermark(entry) == slots[-1] for entry in entries)


def _create_due(store_factory: StoreFactory, count: int) -> set[str]:
    """``count`` due delayed jobs, created in batches of 500 from 8 clients (set-up only)."""
    stores = [store_factory() for _ in range(8)]
    run_at = stores[0].now() - timedelta(minutes=1)

    def create(first: int) -> list[str]:
        news = [
            task_job(f"due-{i}", state=State.PENDING, run_at=run_at + timedelta(microseconds=i))
            for i in range(first, min(first + 500, count))
        ]
        assert all(result.created for result in stores[first // 500 % 8].create_many(news))
        return [new.ref.id for new in news]

    with ThreadPoolExecutor(8) as pool:
        return {ref for batch in pool.map(create, range(0, count, 500)) for ref in batch}


@pytest.mark.slow_backends(*LONG_RACES_SLOW_ON)
def test_three_processes_claim_every_due_job_once(store_factory: StoreFactory) -> None:
    # Given 10,000 due delayed jobs
    expected = _create_due(store_factory, CLAIM_JOBS)
    # When three claimers (processes; threads for memory) sweep them in batches of 100
    results = race(store_factory, "claim", [(100, f"node-{i}") for i in range(3)], processes=3)
    # Then every job was claimed exactly once and the union is the input
    claimed = collections.Counter(job_id for result in results for job_id in result)
    duplicates = [job_id for job_id, n in claimed.items() if n > 1]
    assert duplicates == []
    assert set(claimed) == expected
    store: StateStore = store_factory()
    assert store.claim_due(10, node="late") == []
    assert len(store.list_stale(State.SCHEDULED, 0, CLAIM_JOBS + 1)) == CLAIM_JOBS


def test_eight_nodes_replacing_one_epoch_agree_on_its_successor(
    store_factory: StoreFactory,
) -> None:
    # Given an epoch, and eight nodes (clients) that all found the store forgot writes
    old = store_factory().epoch()
    stores = [store_factory() for _ in range(8)]
    barrier = threading.Barrier(len(stores))

    def replace(store: StateStore) -> str:
        barrier.wait(timeout=60)
        return store.epoch(replace=old)

    # When they all replace it at once
    with ThreadPoolExecutor(len(stores)) as pool:
        successors = list(pool.map(replace, stores))
    # Then one replacement won, and every node holds it
    assert len(set(successors)) == 1 and successors[0] != old
    assert store_factory().epoch() == successors[0]
