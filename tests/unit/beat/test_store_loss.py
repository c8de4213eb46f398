"""The store-loss guard: the floor an epoch sets, and a loss found by re-reading claims."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from celery_exactonce.beat.store_loss import RECHECK_PER_TICK, StoreLossGuard
from celery_exactonce.core import exceptions, jobs, refs, times
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.testing import FrozenClock, InMemoryStore

NOW = datetime(2026, 6, 1, 12, 0, 0, tzinfo=timezone.utc)


def guard() -> StoreLossGuard:
    return StoreLossGuard(max_skew=5.0, window_lookback=300.0)


def created(store: InMemoryStore, name: str) -> JobRef:
    ref = JobRef.submitted(name)
    store.create(NewJob(ref, "t", State.SCHEDULED, node="n", reason="test"))
    return ref


def test_an_epoch_with_a_birth_time_sets_the_floor_max_skew_after_it() -> None:
    g = guard()
    g.adopt(f"token{refs.EPOCH_SEPARATOR}{times.to_micros(NOW)}")
    assert g.floor == NOW + timedelta(seconds=5)
    assert g.floor_reason == "unprovable"
    assert not g.provable(NOW + timedelta(seconds=5))
    assert g.provable(NOW + timedelta(seconds=6))


def test_an_epoch_without_a_time_leaves_every_slot_provable() -> None:
    g = guard()
    g.adopt("legacy-token")
    assert g.floor is None and g.provable(NOW - timedelta(days=1))


def test_claims_still_in_the_store_show_no_loss() -> None:
    store = InMemoryStore(clock=FrozenClock(NOW))
    g = guard()
    g.adopt(store.epoch())
    g.claimed(created(store, "a"), NOW)
    assert g.recheck(store, NOW) is None
    assert g.floor_reason == "unprovable"


def test_a_claim_gone_from_the_store_moves_the_floor_and_replaces_the_epoch() -> None:
    store = InMemoryStore(clock=FrozenClock(NOW))
    g = guard()
    g.adopt(store.epoch())
    old_epoch = g.epoch
    kept = created(store, "kept")
    g.claimed(kept, NOW)
    g.claimed(JobRef.submitted("forgotten"), NOW)  # never written: the store "forgot" it
    found = g.recheck(store, NOW)
    assert found is not None
    assert found.missing == [JobRef.submitted("forgotten")]
    assert found.floor == g.floor and g.floor is not None and g.floor >= NOW + timedelta(seconds=5)
    assert g.floor_reason == "store_loss"
    assert g.epoch != old_epoch and store.epoch() == g.epoch
    assert g.recheck(store, NOW) is None  # the recent claims were dropped with the loss


def test_only_the_newest_claims_within_the_window_are_reread() -> None:
    store = InMemoryStore(clock=FrozenClock(NOW))
    g = guard()
    g.adopt(store.epoch())
    g.claimed(JobRef.submitted("old-forgotten"), NOW - timedelta(seconds=301))  # out of the window
    for i in range(RECHECK_PER_TICK):
        g.claimed(created(store, f"c{i}"), NOW)
    assert g.recheck(store, NOW) is None


class _Unreachable(InMemoryStore):
    def epoch(self, *, replace: str | None = None) -> str:
        raise exceptions.StoreUnavailable("down")


def test_an_epoch_refusal_drops_the_epoch_when_the_new_one_cannot_be_read() -> None:
    store = InMemoryStore(clock=FrozenClock(NOW))
    g = guard()
    g.adopt("old")
    g.epoch_refused(store)
    assert g.epoch == store.epoch() and g.floor_reason == "store_loss"
    g.epoch_refused(_Unreachable(clock=FrozenClock(NOW)))
    assert g.epoch is None


def test_a_store_error_during_the_recheck_propagates() -> None:
    class Failing(InMemoryStore):
        def get(self, ref: JobRef) -> jobs.Job | None:
            raise exceptions.StoreUnavailable("down")

    store = Failing(clock=FrozenClock(NOW))
    g = guard()
    g.claimed(JobRef.submitted("a"), NOW)
    with pytest.raises(exceptions.StoreUnavailable):
        g.recheck(store, NOW)


def test_a_loss_whose_epoch_replacement_fails_is_found_again_on_the_next_recheck() -> None:
    # A failover to a replica that missed this node's last claims, the first write
    # after it landing on a server not yet promoted (READONLY): the replacement of
    # the epoch fails. The loss must not be forgotten with it: the next recheck
    # finds it again, replaces the epoch (so the other nodes' floors move) and
    # reports it.
    class ReplaceFails(InMemoryStore):
        failing = True

        def epoch(self, *, replace: str | None = None) -> str:
            if replace is not None and self.failing:
                raise exceptions.StoreUnavailable("READONLY")
            return super().epoch(replace=replace)

    store = ReplaceFails(clock=FrozenClock(NOW))
    g = guard()
    g.adopt(store.epoch())
    old_epoch = g.epoch
    g.claimed(JobRef.submitted("forgotten"), NOW)
    with pytest.raises(exceptions.StoreUnavailable):
        g.recheck(store, NOW)
    assert g.floor is not None and g.floor >= NOW + timedelta(seconds=5)  # already safe
    store.failing = False
    found = g.recheck(store, NOW + timedelta(seconds=1))
    assert found is not None and found.missing == [JobRef.submitted("forgotten")]
    assert g.epoch != old_epoch and store.epoch() == g.epoch
