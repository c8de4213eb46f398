"""The store's records of skipped slots (``note_skipped``, ``skipped``), on every backend."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from celery_exactonce.core.skipped_slots import SkippedSlots
from tests.support.backends import Factory
from tests.support.helpers import wait_store_past

UTC = timezone.utc


def record(entry: str, where: str = "catchup", count: int = 3) -> SkippedSlots:
    first = datetime(2026, 5, 1, 3, tzinfo=UTC)
    return SkippedSlots(entry, where, first, first + timedelta(minutes=count - 1), count, "node-a")


def test_records_read_back_newest_first_stamped_with_store_time(store_factory: Factory) -> None:
    store = store_factory()
    before = store.now()
    store.note_skipped([record("a"), record("b", "window", 1)])
    store.note_skipped([record("c", "store_loss", 7)])
    found = store.skipped()
    assert [r.entry for r in found] == ["c", "b", "a"]
    assert found[0] == SkippedSlots(
        "c", "store_loss", record("c").first, record("c", count=7).last, 7, "node-a", found[0].at
    )
    assert all(r.at is not None and before <= r.at <= store.now() for r in found)
    assert [r.entry for r in store.skipped(limit=2)] == ["c", "b"]
    assert store.skipped(limit=0) == []


def test_nothing_to_note_writes_nothing_and_namespaces_keep_their_own(
    store_factory: Factory,
) -> None:
    mine, other = store_factory(), store_factory(namespace=f"{store_factory().namespace}-x")
    mine.note_skipped([])
    other.note_skipped([record("theirs")])
    assert mine.skipped() == []
    assert [r.entry for r in other.skipped()] == ["theirs"]


def test_records_past_the_retention_are_not_read(store_factory: Factory) -> None:
    store = store_factory(retention=1.0)
    store.note_skipped([record("old")])
    wait_store_past(store, store.now() + timedelta(seconds=1.2))
    store.note_skipped([record("new")])
    assert [r.entry for r in store.skipped()] == ["new"]
