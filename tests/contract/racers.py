"""Worker functions for the race tests, run in threads and in spawned processes.

Module-level so that a ``spawn`` child can import them.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from datetime import datetime
from typing import Any

from celery_exactonce.core.jobs import CreateStatus
from celery_exactonce.stores.base import StateStore
from tests.support.backends import make_store
from tests.support.helpers import occurrence, task_job

Racer = Callable[..., list[str]]


def create_all(store: StateStore, barrier: Any, ids: list[str], seed: int) -> list[str]:
    """Create every id in a shuffled order; return the ids this caller created."""
    order = list(ids)
    random.Random(seed).shuffle(order)
    barrier.wait(timeout=120)
    return [job_id for job_id in order if store.create(task_job(job_id)).created]


def claim_slots(store: StateStore, barrier: Any, entry: str, slots: list[datetime]) -> list[str]:
    """Claim the slots of one entry in ascending order (as beat does); return those won."""
    barrier.wait(timeout=120)
    return [
        fire.isoformat()
        for fire in slots
        if store.create(occurrence(entry, fire)).status is CreateStatus.CREATED
    ]


def claim_slot_batches(
    store: StateStore, barrier: Any, entries: list[str], slots: list[datetime], seed: int
) -> list[str]:
    """Claim every (entry, slot) with ``create_many`` in batches, entries in a shuffled order.

    Each entry's slots stay ascending (as beat claims them); the order of the
    entries differs per racer, so batched lock orders would deadlock if the
    store did not order them itself. Returns the occurrence ids this caller won.
    """
    order = list(entries)
    random.Random(seed).shuffle(order)
    news = [occurrence(entry, fire) for fire in slots for entry in order]
    barrier.wait(timeout=120)
    won: list[str] = []
    for i in range(0, len(news), 50):
        batch = news[i : i + 50]
        results = store.create_many(batch)
        won += [n.ref.id for n, r in zip(batch, results, strict=True) if r.created]
    return won


def claim_until_empty(store: StateStore, barrier: Any, batch: int, node: str) -> list[str]:
    """Claim due jobs in batches until two calls in a row find none; return the ids claimed."""
    barrier.wait(timeout=120)
    claimed: list[str] = []
    empty_rounds = 0
    while empty_rounds < 2:
        jobs = store.claim_due(batch, node=node)
        empty_rounds = 0 if jobs else empty_rounds + 1
        claimed.extend(job.ref.id for job in jobs)
    return claimed


RACERS: dict[str, Racer] = {
    "create": create_all,
    "slots": claim_slots,
    "claim": claim_until_empty,
    "slot_batches": claim_slot_batches,
}


def run_threads(
    racer: str, stores: list[StateStore], barrier: Any, args: list[tuple[Any, ...]]
) -> list[list[str]]:
    """Run ``RACERS[racer](store, barrier, *args[i])`` in one thread per store."""
    target = RACERS[racer]
    results: list[list[str]] = [[] for _ in stores]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = target(stores[i], barrier, *args[i])
        except BaseException as exc:  # re-raised in the caller below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"a {racer} thread did not finish")
    return results


class ProcessBarrier:
    """The threads of one process meet locally; the last one then meets the other processes."""

    def __init__(self, process_barrier: Any, threads: int) -> None:
        self._local = threading.Barrier(threads, action=lambda: process_barrier.wait(120))

    def wait(self, timeout: float) -> None:
        self._local.wait(timeout=timeout)


def process_main(
    racer: str,
    backend: str,
    url: str,
    namespace: str,
    process_barrier: Any,
    args: list[tuple[Any, ...]],
) -> list[list[str]]:
    """One racing process: a thread (with its own store client) per entry of ``args``."""
    stores = [make_store(backend, url, namespace) for _ in args]
    try:
        return run_threads(racer, stores, ProcessBarrier(process_barrier, len(args)), args)
    finally:
        for store in stores:
            store.close()
