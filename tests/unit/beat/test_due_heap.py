"""The heap of beat entries by next slot (``due_heap``), and what a run-time edit costs a tick.

An edit pushes the edited entry again; the other entries keep their place, so
no tick after an edit computes every entry's next slot (issue 17: a tick's cost
follows its due and changed entries, not the entry count).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from celery_exactonce.beat import scheduler
from celery_exactonce.beat.due_heap import DueHeap
from tests.support.beat_cluster import Cluster, every, isolated

T0 = datetime(2026, 6, 1, 12, 0, 0, tzinfo=timezone.utc)


@pytest.fixture(autouse=True)
def _isolated() -> Iterator[None]:
    with isolated():
        yield


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_pops_what_is_due_in_slot_then_name_order() -> None:
    heap = DueHeap()
    for name, when in (("b", 5), ("a", 5), ("c", 1), ("d", 9)):
        heap.push(name, at(when))
    assert heap.pop_due(at(5)) == [("c", at(1)), ("a", at(5)), ("b", at(5))]
    assert heap.next_time() == at(9) and len(heap) == 1 and "d" in heap


def test_a_name_pushed_again_is_due_once_at_its_new_slot() -> None:
    heap = DueHeap()
    heap.push("a", at(1))
    heap.push("a", at(7))  # edited: its next slot moved
    assert heap.pop_due(at(5)) == []
    assert heap.next_time() == at(7)
    assert heap.pop_due(at(7)) == [("a", at(7))]
    assert heap.pop_due(at(100)) == [] and heap.next_time() is None


def test_a_discarded_name_never_comes_up() -> None:
    heap = DueHeap()
    heap.push("a", at(1))
    heap.push("b", at(2))
    heap.discard("a")
    assert "a" not in heap
    assert heap.next_time() == at(2)
    assert heap.pop_due(at(10)) == [("b", at(2))]


def test_many_pushes_of_one_name_do_not_grow_the_heap_without_bound() -> None:
    heap = DueHeap()
    for i in range(10_000):
        heap.push("a", at(i))
    assert len(heap._heap) < 200  # the dead items were dropped
    assert heap.pop_due(at(20_000)) == [("a", at(9_999))]


def test_an_edit_recomputes_only_the_edited_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a node with 300 hourly entries, its heap built
    schedule: dict[str, Any] = {f"e{i:03}": every(3600) for i in range(300)}
    cluster = Cluster(schedule, nodes=1)
    node = cluster.nodes[0]
    cluster.run(2)
    computed: list[str] = []
    next_slot = scheduler.slots.next_slot

    def counting(schedule: Any, after: datetime, **kwargs: Any) -> datetime | None:
        computed.append(kwargs.get("entry", "?"))
        return next_slot(schedule, after, **kwargs)

    monkeypatch.setattr(scheduler.slots, "next_slot", counting)
    # When one entry is edited to every 10 s, and the node ticks
    node.update_from_dict({"e007": every(10)})
    cluster.run(1)
    # Then only that entry's next slot was computed again
    assert computed == ["e007"]
    # And it runs on its new schedule, while the others wait for the hour
    sent = len(cluster.broker.sent)
    cluster.run(20)
    assert {job.entry for job in cluster.broker.sent[sent:]} == {"e007"}
    assert len(cluster.fired("e007")) >= 2


def test_an_entry_removed_at_run_time_never_runs_again() -> None:
    # Given a node with two every-10-s entries, both run once
    cluster = Cluster({"keep": every(10), "drop": every(10)}, nodes=1)
    node = cluster.nodes[0]
    cluster.run(10)
    ran = len(cluster.fired("drop"))
    # When one is taken out of the schedule (as the django-celery-beat scheduler drops a row)
    node.schedule.pop("drop")
    node._forget("drop")
    cluster.run(30)
    # Then it runs no more, and the other goes on
    assert len(cluster.fired("drop")) == ran
    assert len(cluster.fired("keep")) >= 3
