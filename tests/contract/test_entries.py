"""Stored beat entries in the store (``write_entry``, ``read_entries``, ``entries_revision``),
on every backend."""

from __future__ import annotations

import threading

import pytest

from celery_exactonce.core import exceptions
from tests.support.backends import Factory


def test_an_empty_store_has_revision_zero_and_no_entries(store_factory: Factory) -> None:
    store = store_factory()
    assert store.entries_revision() == 0
    assert store.read_entries() == (0, {})


def test_each_write_moves_the_revision_and_reads_back_in_one_snapshot(
    store_factory: Factory,
) -> None:
    store = store_factory()
    assert store.write_entry("a", '{"v":1}') == 1
    assert store.write_entry("b", '{"v":2}') == 2
    assert store.write_entry("a", '{"v":3}') == 3
    assert store.read_entries() == (3, {"a": '{"v":3}', "b": '{"v":2}'})
    # A delete moves it too, and a delete of nothing still counts as a write
    assert store.write_entry("b", None) == 4
    assert store.write_entry("never", None) == 5
    assert store.read_entries() == (5, {"a": '{"v":3}'})
    assert store.entries_revision() == 5


def test_another_process_sees_the_writes_and_namespaces_keep_their_own(
    store_factory: Factory,
) -> None:
    mine = store_factory()
    again = store_factory(namespace=mine.namespace)
    other = store_factory(namespace=f"{mine.namespace}-x")
    mine.write_entry("shared", "{}")
    assert again.read_entries() == (1, {"shared": "{}"})
    assert other.read_entries() == (0, {})


def test_names_are_checked_and_a_bad_one_writes_nothing(store_factory: Factory) -> None:
    store = store_factory()
    for bad in ("", "x" * 256, "tab\there"):
        with pytest.raises(exceptions.InvalidPayload, match="entry name"):
            store.write_entry(bad, "{}")
    assert store.read_entries() == (0, {})


def test_concurrent_writers_each_get_a_revision_of_their_own(store_factory: Factory) -> None:
    stores = [store_factory() for _ in range(4)]  # memory: one store, four threads
    barrier = threading.Barrier(len(stores))
    got: list[list[int]] = [[] for _ in stores]

    def writer(i: int) -> None:
        barrier.wait(timeout=10)
        for n in range(10):
            got[i].append(stores[i].write_entry(f"w{i}-{n}", f'"{i}-{n}"'))

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    revisions = sorted(r for rs in got for r in rs)
    assert revisions == list(range(1, 41))
    revision, found = stores[0].read_entries()
    assert revision == 40 and len(found) == 40
