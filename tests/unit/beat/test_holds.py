"""``celery_exactonce.beat.holds``: the collector waits for the tick, and is given back."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from celery_exactonce.beat.holds import collector_held
from tests.support.beat_cluster import Cluster, every, isolated


@pytest.fixture(autouse=True)
def _collector_as_found() -> Iterator[None]:
    enabled = gc.isenabled()
    with isolated():
        yield
    (gc.enable if enabled else gc.disable)()


def test_the_collector_is_off_in_the_block_and_on_after_it_even_when_it_raises() -> None:
    gc.enable()
    with collector_held():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_held():
        raise RuntimeError("tick failed")
    assert gc.isenabled()


def test_a_collector_someone_else_turned_off_stays_off() -> None:
    gc.disable()
    with collector_held():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_a_tick_claims_with_the_collector_off_and_gives_it_back() -> None:
    gc.enable()
    cluster = Cluster({"tick": every(1)}, nodes=1)
    node = cluster.nodes[0]
    seen: list[bool] = []
    claim = node._claimer.claim_and_dispatch

    def watched(*args: object, **kwargs: object) -> None:
        seen.append(gc.isenabled())
        claim(*args, **kwargs)  # type: ignore[arg-type]

    node._claimer.claim_and_dispatch = watched  # type: ignore[method-assign]
    cluster.run(3)
    assert seen and not any(seen)
    assert gc.isenabled()
    assert len(cluster.fired("tick")) >= 3
