"""The claim-conflict watch reads at most a few records a tick, however many batches the tick has.

A node that loses a slot's claims compares them with the records that hold
them (:mod:`celery_exactonce.beat.conflicts`). A brief claim answers without
the record, so the watch reads it: at most ``CHECKS_PER_TICK`` a tick, across
every batch of the tick (a tick of 10,000 claims has 20 batches).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from celery_exactonce.beat import conflicts
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.writes import NewJob
from celery_exactonce.testing import InMemoryStore
from tests.support.helpers import occurrence

T0 = datetime(2026, 6, 1, 12, 0, 0, tzinfo=timezone.utc)


class CountingStore(InMemoryStore):
    """An in-memory store that counts its ``get`` calls."""

    gets = 0

    def get(self, ref: JobRef) -> Job | None:
        self.gets += 1
        return super().get(ref)


def _taken(store: InMemoryStore, names: range) -> list[tuple[NewJob, Job | None]]:
    """Claims of ``names`` at T0 that the store holds, answered without their records."""
    news = [occurrence(f"e{i}", T0) for i in names]
    store.create_many(news)
    return [(new, None) for new in news]


def test_the_batches_of_a_tick_share_its_reads_and_the_next_tick_reads_again() -> None:
    # Given a watch over a store holding two batches' worth of claimed slots
    store = CountingStore("ns")
    watch = conflicts.ConflictWatch(store, "node-a")
    per_tick = conflicts.CHECKS_PER_TICK
    first, second = _taken(store, range(0, 20)), _taken(store, range(20, 40))
    # When one tick checks both batches
    watch.check(first, T0)
    watch.check(second, T0)
    # Then it read no more records than a tick may, in all
    assert store.gets == per_tick
    # And the next tick reads again, the entries it has not compared yet
    watch.check(second, T0 + timedelta(seconds=1))
    assert store.gets == 2 * per_tick
