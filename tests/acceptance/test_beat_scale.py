"""Ten beat nodes, 10,000 entries every minute, five slots, on one store: none missed or twice.

Ten real ``celery beat -S exactonce`` processes share one
store (Redis, or PostgreSQL) and tick the ledger app's 10,000 entries, each due
every minute. Over five whole slots, each ``(entry, fire_time)`` must be
claimed once (a record in the store, dispatched once) and published once (one
message with its id on the broker queue, which nobody consumes). The claim
rate (slot to last claim, per slot) and how the wins spread over the nodes are
printed; on PostgreSQL the median from a slot to its last claim is held to
the target of :data:`TARGET_MEDIAN` (``beat_scale.py`` runs the same measure
for 1, 2, 5, 10 nodes).

Minutes long, so marked slow: ``tox -e chaos``.
"""

from __future__ import annotations

import statistics

import pytest

from tests.acceptance import beat_scale
from tests.acceptance.harness import Deployment

NODES = 10
ENTRIES = 10_000
EVERY = 60.0
SLOTS = 5
#: Seconds from a slot to its last claim, median over the slots, on PostgreSQL (at most).
TARGET_MEDIAN = 15.0


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis", "postgres"))
def test_ten_beats_claim_every_slot_of_ten_thousand_entries_once(
    deployment: Deployment,
) -> None:
    # Given ten beat nodes on one store, each with the same 10,000 every-minute entries
    # When they run for five whole slots
    run = beat_scale.run(deployment, nodes=NODES, entries=ENTRIES, every=EVERY, slots=SLOTS)
    print(run.report())

    # Then every (entry, fire_time) of the five slots was claimed, by one of the nodes
    assert len(run.expected) == ENTRIES * SLOTS
    missing = run.missing()
    assert not missing, f"{len(missing)} occurrence(s) never claimed, e.g. {sorted(missing)[:3]}"
    # And none was dispatched twice, nor published twice anywhere in the run
    duplicates = run.duplicates()
    assert not duplicates, f"{len(duplicates)} published twice: {sorted(duplicates.items())[:3]}"
    # And each of the window's occurrences is on the queue, once
    unpublished = run.unpublished(deployment.namespace)
    assert not unpublished, f"{len(unpublished)} claimed but not on the queue"
    # And on PostgreSQL the slots' last claims came within the target, at the median
    if deployment.store_kind == "postgres":
        median = statistics.median(run.latencies())
        assert median <= TARGET_MEDIAN, f"slot to last claim: median {median:.1f} s"
