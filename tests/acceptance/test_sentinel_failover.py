"""Issue 17's acceptance run on Sentinel: three beats and a worker through two master SIGKILLs.

A private Sentinel group (tests/integration/redis_server.py: one master, two
replicas, three sentinels, local processes on free ports, no persistence) is
the store, ``redis+sentinel://``; the broker stays on the shared Redis (the
harness's broker DB). Three ``celery beat -S exactonce`` processes tick 10
every-second entries for 120 s while a worker runs the bodies. At 40 s and at
80 s the current master (as a sentinel names it) is SIGKILLed; the test polls
until the sentinels have promoted a replica, and after the first failover
starts the killed server again, empty, as a replica of the new master, so that
the second master too has two replicas when it dies.

* ``exactonce_min_replicas=1``: no occurrence is published twice (the beats'
  ``dispatched`` events, the store's dispatch count), no gated body runs twice
  (the ledger), and every slot of the window that did not run is counted:
  skipped by some beat (``slot_skipped_entry``, or the store's record of
  skipped slots), or a claim the store still shows unfinished (``SCHEDULED``,
  ``DISPATCHED``, ``TIMEOUT``).
* ``exactonce_min_replicas=0``: the same run, measured and not judged: its
  duplicates, skips and uncounted misses are printed (``SENTINEL RUN`` lines,
  ``pytest -s``) for docs/howto/store-redis.md.

The reconciler's knobs are shortened (``replay_age`` 12 s, a pass every 5 s)
so that a claim a failover left unpublished is replayed within the run; the
claim and dispatch paths are the shipped ones.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import pytest

from celery_exactonce.core.states import State
from tests.acceptance import beats as b
from tests.acceptance.harness import BeatProcess, Deployment, Ledger
from tests.integration.redis_server import (
    SERVICE,
    RedisServer,
    SentinelGroup,
    sentinel_group,
    wait_for,
)

pytestmark = [pytest.mark.slow]

ENTRIES = 10
#: Seconds (monotonic) the beats run for, from "every beat started".
RUN_SECONDS = 120
#: When (seconds into the run) the current master is SIGKILLed.
KILL_AT = (40, 80)
#: See test_beat.py: the window starts after every beat ticked and the claim floor
#: passed, and ends before the final SIGKILL of the beats.
START_MARGIN = 2
END_MARGIN = 3
#: How long the sentinels get to promote a replica (they take ~1-3 s: down-after 1 s).
FAILOVER_TIMEOUT = 30.0

#: Settings of every process: the reconciler replays a claim a failover left
#: unpublished within the run (replay_age >= 2 x (tick + publish + store timeouts)).
SETTINGS: dict[str, Any] = {
    "exactonce_store_timeout": 2.0,
    "exactonce_publish_timeout": 3.0,
    "exactonce_replay_age": 12.0,
    "exactonce_dispatch_timeout": 30.0,
    "exactonce_reconcile_interval": 5.0,
}

#: Store states of a claim that was not (or not known to be) run: visible, counted.
UNFINISHED = frozenset({State.SCHEDULED, State.DISPATCHED, State.TIMEOUT})


@dataclass
class Failover:
    """One SIGKILL of the master and what followed."""

    killed_port: int
    new_port: int
    #: Seconds from the SIGKILL until the new master took writes.
    promoted_after: float
    killed_real: float


@dataclass
class Figures:
    """What the run measured over its window."""

    min_replicas: int
    slots: int
    ran: int
    #: job id -> times some beat published it (beat slot and reconciler replays).
    published_twice: dict[str, int]
    #: Occurrences the store shows dispatched more than once.
    store_dispatched_twice: list[b.Occurrence]
    #: Occurrences whose body ran more than once, gated and plain.
    gated_ran_twice: list[b.Occurrence]
    plain_ran_twice: list[b.Occurrence]
    missed: set[b.Occurrence]
    #: Slots skipped and counted, with the reasons (``where``) they were counted under.
    skipped: dict[b.Occurrence, set[str]]
    unfinished: set[b.Occurrence]
    uncounted: set[b.Occurrence]
    gate_suppressed: int
    failovers: list[Failover] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "min_replicas": self.min_replicas,
            "slots": self.slots,
            "ran": self.ran,
            "published_twice": len(self.published_twice),
            "store_dispatched_twice": len(self.store_dispatched_twice),
            "gated_ran_twice": len(self.gated_ran_twice),
            "plain_ran_twice": len(self.plain_ran_twice),
            "missed": len(self.missed),
            "missed_skipped": len(self.missed & self.skipped.keys()),
            "missed_skipped_by_reason": dict(
                Counter(
                    where
                    for occurrence in self.missed
                    for where in sorted(self.skipped.get(occurrence, ()))
                )
            ),
            "missed_unfinished": len(self.missed & self.unfinished),
            "missed_uncounted": len(self.uncounted),
            "gate_suppressed_deliveries": self.gate_suppressed,
            "failover_seconds": [round(f.promoted_after, 2) for f in self.failovers],
        }


# --- the Sentinel group ---------------------------------------------------------------------


def _sentinels_see_replicas(group: SentinelGroup, count: int) -> bool:
    """Every sentinel knows ``count`` healthy replicas of the current master."""
    for sentinel in group.sentinels:
        replicas = sentinel.client(1.0).sentinel_slaves(SERVICE)
        healthy = [
            r
            for r in replicas
            if not ({"s_down", "o_down", "disconnected"} & set(_flags(r)))
            and r.get("master-link-status") == "ok"
        ]
        if len(healthy) < count:
            return False
    return True


def _flags(replica: dict[str, Any]) -> list[str]:
    flags = replica.get("flags", "")
    return sorted(flags) if isinstance(flags, (set, list, tuple)) else str(flags).split(",")


def fail_over(group: SentinelGroup, *, restart: bool) -> Failover:
    """SIGKILL the master a sentinel names; poll until another is promoted and writable.

    With ``restart``, the killed server starts again (empty) as a replica of the
    new master, and the call returns once the new master has two replicas online
    and every sentinel sees both.
    """
    old: RedisServer = group.current_master()
    killed_port = old.port
    killed_real = time.time()
    started = time.monotonic()
    new = group.failover_after_kill(timeout=FAILOVER_TIMEOUT)
    promoted_after = time.monotonic() - started
    if restart:
        old.extra = ("--replicaof", "127.0.0.1", str(new.port))
        old.start()
        group.wait_replicas(2, timeout=FAILOVER_TIMEOUT)
        wait_for(
            "every sentinel seeing two replicas",
            lambda: _sentinels_see_replicas(group, 2),
            FAILOVER_TIMEOUT,
        )
    return Failover(killed_port, new.port, promoted_after, killed_real)


# --- the run --------------------------------------------------------------------------------


def _watch(beats: list[BeatProcess], until: float) -> None:
    """Poll (monotonic) until ``until``; fail at once if a beat exits."""
    while time.monotonic() < until:
        for beat in beats:
            if not beat.alive():
                raise AssertionError(f"{beat!r} exited; log:\n{beat.log_tail()}")
        time.sleep(0.1)


def _store_now(deployment: Deployment) -> datetime:
    """The store's clock, polled through a failover's seconds of refusals."""
    found: list[datetime] = []

    def read() -> bool:
        found.append(b.store_now(deployment))
        return True

    wait_for("the store's clock", read, FAILOVER_TIMEOUT)
    return found[-1]


def _measure(
    deployment: Deployment,
    ledger: Ledger,
    beats: list[BeatProcess],
    expected: set[b.Occurrence],
    min_replicas: int,
) -> Figures:
    runs = Counter[tuple[str, b.Occurrence]]()
    for row in ledger.rows(phase="run"):
        if (occurrence := row.occurrence) is not None:
            runs[(row.task, occurrence)] += 1
    ran = {occurrence for _, occurrence in runs}
    published = b.publishes(beats)
    store_twice = []
    unfinished = set()
    for entry, fire in sorted(expected):
        job = b.job_of(deployment, entry, fire)
        if job is None:
            continue
        if job.dispatches > 1:
            store_twice.append((entry, fire))
        if job.state in UNFINISHED:
            unfinished.add((entry, fire))
    missed = expected - ran
    skipped = b.skipped_slots(beats, deployment)
    return Figures(
        min_replicas=min_replicas,
        slots=len(expected),
        ran=len(expected & ran),
        published_twice={job: n for job, n in published.items() if n > 1},
        store_dispatched_twice=store_twice,
        gated_ran_twice=sorted(
            o for (task, o), n in runs.items() if n > 1 and task == "gated_beat"
        ),
        plain_ran_twice=sorted(
            o for (task, o), n in runs.items() if n > 1 and task != "gated_beat"
        ),
        missed=missed,
        skipped=skipped,
        unfinished=unfinished,
        uncounted=missed - skipped.keys() - unfinished,
        gate_suppressed=deployment.skipped_deliveries(),
    )


@pytest.mark.timeout(420)
@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis",))
@pytest.mark.parametrize("min_replicas", [1, 0])
def test_three_beats_through_two_sentinel_failovers(
    deployment: Deployment, ledger: Ledger, gate: None, min_replicas: int
) -> None:
    with sentinel_group(replicas=2, sentinels=3) as group:
        deployment.store_url = group.url()  # the broker stays on the shared Redis
        deployment.extra_env["EXACTONCE_ACC_EXTRA_CONF"] = json.dumps(
            {**SETTINGS, "exactonce_min_replicas": min_replicas}
        )
        try:
            # Given a worker and three beats on a Sentinel-backed store
            deployment.start_worker(concurrency=4)
            beats = b.start_beats(deployment, [{}, {}, {}], entries=ENTRIES)
            began = time.monotonic()
            started = _store_now(deployment)
            window_start = max(started, b.claim_floor(deployment)) + timedelta(seconds=START_MARGIN)

            # When the master is SIGKILLed twice, a replica promoted each time
            failovers = []
            for index, at in enumerate(KILL_AT):
                _watch(beats, began + at)
                failovers.append(fail_over(group, restart=index < len(KILL_AT) - 1))
            _watch(beats, began + RUN_SECONDS)
            for beat in beats:
                beat.kill()
            stopped = _store_now(deployment)
            expected = b.slots(
                b.entry_names(ENTRIES), window_start, stopped - timedelta(seconds=END_MARGIN)
            )
            b.wait_executed(ledger, expected)
            figures = _measure(deployment, ledger, beats, expected, min_replicas)
            figures.failovers = failovers
        finally:
            deployment.close()  # while the Sentinel group is still up

    print(f"\nSENTINEL RUN {json.dumps(figures.summary(), sort_keys=True)}")
    for name in ("published_twice", "gated_ran_twice", "plain_ran_twice", "uncounted"):
        value = getattr(figures, name)
        if value:
            print(f"SENTINEL RUN {name}: {sorted(value)[:10]}")

    # Then each failover happened (another server took writes), within seconds
    assert len(figures.failovers) == len(KILL_AT)
    for failover in figures.failovers:
        assert failover.new_port != failover.killed_port
        assert failover.promoted_after < FAILOVER_TIMEOUT
    # ... runs resumed after the second failover: a slot after it ran
    last_kill = figures.failovers[-1].killed_real
    assert any(
        event["real"] > last_kill + figures.failovers[-1].promoted_after
        for beat in beats
        for event in beat.events("dispatched")
    ), "no beat published after the second failover"
    assert figures.slots >= ENTRIES * 100 and figures.ran > figures.slots // 2, figures.summary()
    if min_replicas:
        # ... nothing published twice, no gated body run twice, every miss counted
        assert not figures.published_twice, figures.summary()
        assert not figures.store_dispatched_twice, figures.summary()
        assert not figures.gated_ran_twice, figures.summary()
        assert not figures.plain_ran_twice, figures.summary()
        assert not figures.uncounted, (
            f"{len(figures.uncounted)} missed slot(s) neither skipped nor held by the store:\n"
            f"{sorted(figures.uncounted)[:10]}"
        )
