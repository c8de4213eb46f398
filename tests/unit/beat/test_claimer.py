"""``celery_exactonce.beat.claimer``: each entry's job built once, and each node's own start."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest

from celery_exactonce.beat import entries
from celery_exactonce.beat.claimer import rotated
from celery_exactonce.beat.planner import Plan
from tests.support.beat_cluster import START, Cluster, every, isolated


@pytest.fixture(autouse=True)
def _counters_and_signals() -> Iterator[None]:
    with isolated():
        yield


def test_every_slot_job_is_the_job_built_afresh_for_that_slot_but_its_rev() -> None:
    # Given an entry with arguments, options and a deadline, on one node
    entry = {
        **every(1, queue="q", exactonce={"deadline": 30}),
        "args": [1, {"a": 2}],
        "kwargs": {"k": "v"},
    }
    cluster = Cluster({"tick": entry}, nodes=1)
    # When it fires over several slots
    cluster.run(5)
    # Then each slot's job is the one entries.occurrence builds for it, with a rev of its own
    node = cluster.nodes[0]
    sent = [job for job in cluster.broker.sent if job.entry == "tick"]
    assert len(sent) >= 5
    for job in sent:
        assert job.fire_time is not None
        fresh = entries.occurrence(
            "tick",
            node.schedule["tick"],
            job.fire_time,
            node._policies["tick"],
            namespace=cluster.store.namespace,
            node=job.node,
        )
        assert (job.ref, job.args, job.kwargs, job.deadline) == (
            fresh.ref,
            fresh.args,
            fresh.kwargs,
            fresh.deadline,
        )
        assert job.deadline == job.fire_time + timedelta(seconds=30)
        assert {k: v for k, v in job.options.items() if k in fresh.options} == fresh.options
    assert len({job.history[0].rev for job in sent}) == len(sent)


def test_an_entry_edited_in_place_between_slots_sends_its_new_arguments() -> None:
    # Given an entry that fired
    cluster = Cluster({"tick": {**every(1), "args": [1, [2]]}}, nodes=1)
    cluster.run(2)
    node = cluster.nodes[0]
    assert cluster.broker.sent and all(job.args == [1, [2]] for job in cluster.broker.sent)
    # When its arguments and options are changed in place, nested ones included
    node.schedule["tick"].args[1].append(3)
    node.schedule["tick"].options["priority"] = 7
    edited = cluster.clock.now()
    cluster.run(2)
    # Then the slots after the edit carry them
    after = [job for job in cluster.broker.sent if job.fire_time and job.fire_time > edited]
    assert after
    assert all(job.args == [1, [2, 3]] and job.options["priority"] == 7 for job in after)


def _plans(count: int) -> list[Plan]:
    return [Plan(f"entry-{i}", START) for i in range(count)]


def test_rotated_keeps_every_plan_in_its_cyclic_order_from_a_start_of_the_nodes_own() -> None:
    plans = _plans(100)
    starts = set()
    for node in (f"host:{pid}" for pid in range(1000, 1010)):
        mine = rotated(plans, node)
        assert mine == rotated(plans, node)  # the same start at every tick
        start = plans.index(mine[0])
        assert mine == plans[start:] + plans[:start]
        starts.add(start)
    # Ten nodes start at several places (not all racing for the first batch)
    assert len(starts) >= 5


def test_rotated_leaves_fewer_than_two_plans_as_they_are() -> None:
    assert rotated([], "n") == []
    one = _plans(1)
    assert rotated(one, "n") == one
