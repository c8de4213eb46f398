"""``status``'s skipped slots on a new store and after a loss: two beat nodes, in process.

Two :class:`~celery_exactonce.beat.scheduler.ExactOnceScheduler` nodes tick on one
store (:class:`tests.support.beat_cluster.Cluster`), and ``status`` reads what
they noted (:func:`celery_exactonce.cli.inspect.status_data`).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest

from celery_exactonce import runtime
from celery_exactonce.cli import base
from celery_exactonce.cli.inspect import status_data
from tests.support.beat_cluster import START, Cluster, every, isolated

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def _isolated() -> Any:
    with isolated():
        yield


def _skipped(cluster: Cluster) -> list[dict[str, Any]]:
    session = base.Session(cluster.app, runtime.config_for(cluster.app), cluster.store)
    rows: list[dict[str, Any]] = status_data(session)["skipped"]
    return rows


def test_a_new_store_shows_no_slot_before_its_birth_and_a_loss_once_not_per_node() -> None:
    """Before the fix each node noted every slot of its look-back window before the
    store's first epoch as ``unprovable`` (300 a node, one row each): a store on
    its first day looked as if it had lost them, twice.
    """
    cluster = Cluster({"tick": every(1)}, nodes=2, store_born=START)
    cluster.tick_all()
    cluster.run(10)
    rows = _skipped(cluster)
    born = START.isoformat()
    assert [r for r in rows if r["first"] < born] == [], rows
    unprovable = [r for r in rows if r["where"] == "unprovable"]  # birth .. birth + max_skew
    edge = (START + timedelta(seconds=5)).isoformat()
    assert unprovable and all(r["last"] <= edge for r in unprovable), unprovable
    ranges = [(r["first"], r["last"]) for r in unprovable]
    assert len(ranges) == len(set(ranges)), unprovable  # noted by both nodes, one row each

    cluster.store.simulate_loss()  # wiped after start: a real loss
    lost_at = cluster.clock.now()
    cluster.run(10)
    lost = [r for r in _skipped(cluster) if r["where"] == "store_loss"]
    assert lost and all(datetime.fromisoformat(r["last"]) >= lost_at for r in lost), lost
    ranges = [(r["entry"], r["first"], r["last"]) for r in lost]
    assert len(ranges) == len(set(ranges)), lost  # one row per range, whichever node noted it
    assert sum(r["count"] for r in lost) <= (lost_at - START) / timedelta(seconds=1) + 10
