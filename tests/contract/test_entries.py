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


def test_a_write_that_expects_a_definition_writes_only_over_that_one(
    store_factory: Factory,
) -> None:
    store = store_factory()
    # Expected absent: the first writer makes it, the second finds it and writes nothing
    assert store.write_entry("a", '"one"', expect=None) == 1
    assert store.write_entry("a", '"two"', expect=None) is None
    # Expected as read: written; as read before another's write: not written
    assert store.write_entry("a", '"three"', expect='"one"') == 2
    assert store.write_entry("a", '"four"', expect='"one"') is None
    assert store.read_entries() == (2, {"a": '"three"'})
    # A delete that expects what is there
    assert store.write_entry("a", None, expect='"two"') is None
    assert store.write_entry("a", None, expect='"three"') == 3
    assert store.read_entries() == (3, {})


def test_concurrent_read_modify_writes_lose_no_change(store_factory: Factory) -> None:
    """Eight writers each add their mark to one entry, reading again when another won."""
    stores = [store_factory() for _ in range(8)]
    stores[0].write_entry("shared", "")
    barrier = threading.Barrier(len(stores))

    def writer(i: int) -> None:
        barrier.wait(timeout=10)
        while True:
            current = stores[i].read_entries()[1]["shared"]
            if stores[i].write_entry("shared", current + str(i), expect=current) is not None:
                return

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(stores[0].read_entries()[1]["shared"]) == [str(i) for i in range(8)]
