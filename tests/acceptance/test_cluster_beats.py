"""Issue 17's acceptance runs on a Redis Cluster: three beats and a worker, the namespace sharded.

A private Redis Cluster (tests/integration/redis_server.py: three masters with a
replica each, local processes on free ports, no persistence, killed by pid) is
the store, ``redis+cluster://`` with ``exactonce_shards=3`` (the namespace over
three slots, on whichever masters serve them); the broker stays on the shared Redis (the
harness's broker DB). Three ``celery beat -S exactonce`` processes tick 10
every-second entries while a worker runs the bodies.

* One beat is SIGKILLed and restarted mid-run: every slot of the window runs
  exactly once, less the claims the SIGKILL cut off (counted as test_beat.py
  counts them: the killed node's, unpublished, in the tick its kill cut short).
* SCENARIOS 72: one shard's slot is moved to another master while the beats
  run, by hand as ``redis-cli --cluster reshard`` does it (``SETSLOT
  IMPORTING/MIGRATING``, ``MIGRATE`` of its keys, ``SETSLOT NODE``), held
  half-migrated until a beat has failed a claim closed. No occurrence is
  published or run twice, and every slot of the window ran or is counted:
  skipped by some beat (its events, the store's record), or a claim the store
  still shows unfinished.

Each run prints its figures (``CLUSTER RUN`` lines, ``pytest -s``).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from datetime import datetime, timedelta
from typing import Any

import pytest

from celery_exactonce.core.states import State
from celery_exactonce.stores.redis.sharded import ShardedRedisStore
from celery_exactonce.stores.shards import shard_of
from tests.acceptance import beats as b
from tests.acceptance.harness import BeatProcess, Deployment, Ledger, poll
from tests.integration.redis_server import Cluster, cluster

pytestmark = [pytest.mark.slow]

ENTRIES = 10
SHARDS = 3
#: Seconds (monotonic) the beats run for, from "every beat started".
RUN_SECONDS = 60
#: When (seconds into the run) a beat is SIGKILLed and restarted.
KILL_AT = 30
#: When (seconds into the run) the slot starts to move.
MOVE_AT = 20
#: How long the slot is held half-migrated at most, waiting for a beat to fail closed.
HOLD_TIMEOUT = 15.0
#: See test_beat.py: the window starts after every beat ticked and the claim floor
#: passed, and ends before the final SIGKILL of the beats.
START_MARGIN = 2
END_MARGIN = 3

#: Settings of every process: the namespace over three shards; the reconciler
#: replays a claim left unpublished within the run (as test_sentinel_failover.py).
SETTINGS: dict[str, Any] = {
    "exactonce_shards": SHARDS,
    "exactonce_store_timeout": 2.0,
    "exactonce_publish_timeout": 3.0,
    "exactonce_replay_age": 12.0,
    "exactonce_dispatch_timeout": 30.0,
    "exactonce_reconcile_interval": 5.0,
}

#: Store states of a claim that was not (or not known to be) run: visible, counted.
UNFINISHED = frozenset({State.SCHEDULED, State.DISPATCHED, State.TIMEOUT})


def _on_cluster(deployment: Deployment, group: Cluster) -> None:
    deployment.store_url = group.url()  # the broker stays on the shared Redis
    deployment.store_options = {"shards": SHARDS}
    deployment.extra_env["EXACTONCE_ACC_EXTRA_CONF"] = json.dumps(SETTINGS)


def _watch(beats: list[BeatProcess], until: float) -> None:
    """Poll (monotonic) until ``until``; fail at once if a beat exits."""

    def reached() -> bool:
        for beat in beats:
            if not beat.alive():
                raise AssertionError(f"{beat!r} exited; log:\n{beat.log_tail()}")
        return time.monotonic() >= until

    poll(reached, timeout=max(0.0, until - time.monotonic()) + 10.0, interval=0.1)


def _store_now(deployment: Deployment) -> datetime:
    """The store's clock, read again through a moving slot's refusals."""
    found: list[datetime] = []

    def read() -> bool:
        try:
            found.append(b.store_now(deployment))
        except Exception:  # a redirection the client is still following
            return False
        return True

    poll(read, timeout=15, interval=0.1)
    return found[-1]


def _fail_closed(beats: list[BeatProcess], after_real: float = 0.0) -> int:
    return sum(1 for beat in beats for e in beat.events("fail_closed") if e["real"] >= after_real)


def _figures(
    deployment: Deployment,
    ledger: Ledger,
    beats: list[BeatProcess],
    expected: set[b.Occurrence],
    excused: set[b.Occurrence],
) -> dict[str, Any]:
    """The run's figures over its window; ``excused``: misses a SIGKILL accounts for."""
    runs = Counter[b.Occurrence]()
    for row in ledger.rows(phase="run"):
        if (occurrence := row.occurrence) is not None:
            runs[occurrence] += 1
    ran = expected & set(runs)
    missed = expected - ran
    unfinished = set()
    store_twice = []
    for entry, fire in sorted(expected):
        job = b.job_of(deployment, entry, fire)
        if job is not None and job.dispatches > 1:
            store_twice.append((entry, fire))
        if job is not None and job.state in UNFINISHED:
            unfinished.add((entry, fire))
    skipped = b.skipped_slots(beats, deployment)
    return {
        "slots": len(expected),
        "ran": len(ran),
        "ran_twice": sorted(o for o, n in runs.items() if n > 1),
        "published_twice": sorted(j for j, n in b.publishes(beats).items() if n > 1),
        "store_dispatched_twice": store_twice,
        "missed": len(missed),
        "missed_sigkill": len(missed & excused),
        "missed_skipped": len(missed & skipped.keys()),
        "missed_unfinished": len(missed & unfinished),
        "uncounted": sorted(missed - excused - skipped.keys() - unfinished),
        "fail_closed": _fail_closed(beats),
        "gate_suppressed_deliveries": deployment.skipped_deliveries(),
    }


def _report(name: str, figures: dict[str, Any]) -> None:
    counts = {k: (len(v) if isinstance(v, list) else v) for k, v in figures.items()}
    print(f"\nCLUSTER RUN {name} {json.dumps(counts, sort_keys=True)}")
    for key in ("ran_twice", "published_twice", "store_dispatched_twice", "uncounted"):
        if figures[key]:
            print(f"CLUSTER RUN {name} {key}: {figures[key][:10]}")


def _assert_clean(figures: dict[str, Any]) -> None:
    counts = {k: (len(v) if isinstance(v, list) else v) for k, v in figures.items()}
    assert not figures["ran_twice"], counts
    assert not figures["published_twice"], counts
    assert not figures["store_dispatched_twice"], counts
    assert not figures["uncounted"], (
        f"{len(figures['uncounted'])} missed slot(s) neither skipped, unfinished in the store "
        f"nor cut off by a SIGKILL: {figures['uncounted'][:10]}"
    )
    assert figures["slots"] >= ENTRIES * (RUN_SECONDS - 15), counts


@pytest.mark.timeout(300)
@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis",))
def test_three_beats_on_a_sharded_cluster_run_every_slot_once_through_a_sigkill(
    deployment: Deployment, ledger: Ledger, gate: None
) -> None:
    with cluster(masters=3, replicas_per_master=1) as group:
        _on_cluster(deployment, group)
        try:
            # Given a worker and three beats on a namespace over three shards, each
            # shard home to some of the entries
            assert isinstance(deployment.store(), ShardedRedisStore)
            shards = {shard_of(entry, SHARDS) for entry in b.entry_names(ENTRIES)}
            assert shards == set(range(SHARDS))
            deployment.start_worker(concurrency=4)
            beats = b.start_beats(deployment, [{}, {}, {}], entries=ENTRIES)
            began = time.monotonic()
            started = b.store_now(deployment)
            window_start = max(started, b.claim_floor(deployment)) + timedelta(seconds=START_MARGIN)

            # When one beat is SIGKILLed mid-run, and restarted
            _watch(beats, began + KILL_AT)
            victim = beats[0]
            victim.kill()
            kills = {victim.node: b.store_now(deployment)}
            beats[0] = deployment.start_beat(every=1, entries=ENTRIES)
            _watch(beats, began + RUN_SECONDS)
            for beat in beats:
                beat.kill()
            everyone = [victim, *beats]
            stopped = b.store_now(deployment)
            expected = b.slots(
                b.entry_names(ENTRIES), window_start, stopped - timedelta(seconds=END_MARGIN)
            )
            orphans = b.unpublished_claims(deployment, expected - set(ledger.occurrences()), kills)
            b.wait_executed(ledger, expected - orphans)
            figures = _figures(deployment, ledger, everyone, expected, orphans)
            _report("sigkill", figures)

            # Then nothing ran twice, and every slot but the SIGKILL's orphans ran once
            _assert_clean(figures)
            b.assert_each_ran_once(deployment, ledger, expected - orphans)
            b.assert_keys_match(deployment, ledger)
            b.assert_published_once(deployment, expected - orphans)
            # ... and every beat took part
            for beat in everyone:
                assert b.dispatched_by(beat) > 0, f"{beat!r} published nothing:\n{beat.log_tail()}"
        finally:
            deployment.close()  # while the cluster is still up


def _shard_slot(store: ShardedRedisStore, group: Cluster, shard: int) -> int:
    meta = store._parts[shard]._key("meta")
    return int(group.servers[0].client(1.0).execute_command("CLUSTER KEYSLOT", meta))


@pytest.mark.timeout(300)
@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis",))
def test_scenario_72_resharding_during_a_run_fails_claims_closed_no_duplicate_no_silent_loss(
    deployment: Deployment, ledger: Ledger, gate: None
) -> None:
    with cluster(masters=3, replicas_per_master=1) as group:
        _on_cluster(deployment, group)
        try:
            # Given a worker and three beats on a namespace over three shards
            store = deployment.store()
            assert isinstance(store, ShardedRedisStore)
            deployment.start_worker(concurrency=4)
            beats = b.start_beats(deployment, [{}, {}, {}], entries=ENTRIES)
            began = time.monotonic()
            started = b.store_now(deployment)
            window_start = max(started, b.claim_floor(deployment)) + timedelta(seconds=START_MARGIN)

            # When the slot of the shard with the most entries moves to another master:
            # half its keys migrated, held there until a beat failed a claim closed
            # (or HOLD_TIMEOUT), then the rest and SETSLOT NODE
            _watch(beats, began + MOVE_AT)
            per_shard = Counter(shard_of(e, SHARDS) for e in b.entry_names(ENTRIES))
            shard = per_shard.most_common(1)[0][0]
            slot = _shard_slot(store, group, shard)
            source = group.owner(slot)
            target = next(s for s in group.master_servers() if s.port != source.port)
            moving_real = time.time()
            move = group.begin_move(slot, source, target)
            half = move.migrate(limit=max(1, move.keys_left() // 2))
            try:
                poll(lambda: _fail_closed(beats, moving_real) > 0, timeout=HOLD_TIMEOUT)
                held_until_fail = True
            except AssertionError:
                held_until_fail = False
            held = time.time() - moving_real
            rest = move.finish()
            moved_real = time.time()
            _watch(beats, began + RUN_SECONDS)
            for beat in beats:
                beat.kill()
            stopped = _store_now(deployment)
            expected = b.slots(
                b.entry_names(ENTRIES), window_start, stopped - timedelta(seconds=END_MARGIN)
            )
            b.wait_executed(ledger, expected)
            figures = _figures(deployment, ledger, beats, expected, set())
            figures.update(
                shard=shard,
                slot=slot,
                keys_moved=half + rest,
                held_seconds=round(held, 2),
                held_until_fail_closed=held_until_fail,
                fail_closed_during_move=_fail_closed(beats, moving_real)
                - _fail_closed(beats, moved_real),
                fail_closed_after_move=_fail_closed(beats, moved_real),
            )
            _report("scenario-72", figures)

            # Then the slot is the target's, claims failed closed while it moved
            assert group.owner(slot).port == target.port
            assert figures["fail_closed"] > 0, figures
            # ... and nothing ran or was published twice, no slot missed uncounted
            _assert_clean(figures)
            # ... and claims resumed on the moved shard after the move
            assert any(
                row.occurrence is not None
                and shard_of(row.occurrence[0], SHARDS) == shard
                and row.at > moved_real + 2
                for row in ledger.rows(phase="run")
            ), "no occurrence of the moved shard ran after the move"
        finally:
            deployment.close()  # while the cluster is still up
