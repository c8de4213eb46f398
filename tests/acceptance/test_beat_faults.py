"""Real beats under faults: skewed and jumping node clocks, a Redis store restarted empty.

``celery beat -S exactonce`` processes and a worker, entries every second,
asserting on the ledger the bodies write and on the store.

* Node clocks: the scheduler judges due-ness on the store's clock, so a node
  whose clock is off (by a second either way, jumping an hour ahead or
  stepping a minute back mid-run) changes nothing: no slot runs twice or goes
  missing. The clocks are skewed inside the beat processes by ``ledger_app``
  (``EXACTONCE_ACC_CLOCK_*``, there is no libfaketime here), and the test
  checks the skew was real. On PostgreSQL by default, on Redis too under
  ``-m slow``: no store reads a node's clock (their own clocks are the
  contract suite's, on every store), and Redis's beats run in the default run
  in test_beat.py and in the store-loss test below.
* Store loss: a private redis-server is the store (the broker stays on the
  shared Redis); it is SIGKILLed and started again empty, without persistence.
  No slot runs twice, runs resume, and the beats report the loss and count the
  slots they can no longer prove unclaimed.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest

from tests import services
from tests.acceptance import beats as b
from tests.acceptance.apps.ledger_app import CLOCK_MARK
from tests.acceptance.harness import BeatProcess, Deployment, Ledger, poll
from tests.integration.redis_server import RedisServer, redis_server

ENTRIES = 10
#: See test_beat.py: the window starts this long after every beat started and
#: the claim floor passed, and ends this long before the stop (a SIGKILL mid-tick
#: at the stop may leave a claimed slot unpublished, for the reconciler).
START_MARGIN = 2
END_MARGIN = 3


# --- node clocks ------------------------------------------------------------------------------

#: Seconds of store time the clock test runs for, from "every beat started".
CLOCK_RUN = 30
#: Seconds (monotonic, from its import) after which the third node's clock jumps:
#: about a third into the measured window.
JUMP_AFTER = 14
JUMP = 3600.0
#: The fourth node's clock steps back this much at the same point (scenario 23).
STEP_BACK = -60.0


def _skews(beat: BeatProcess) -> list[tuple[float, float]]:
    """``(real time, node clock - real clock)`` of each record the beat logged."""
    return [(event["real"], event["created"] - event["real"]) for event in beat.events()]


def _jumped_at(beat: BeatProcess) -> float:
    """The real time at which ``beat``'s clock jumped, from the mark ``ledger_app`` wrote."""
    found = re.search(rf"{re.escape(CLOCK_MARK)} jumped by \S+ s: real=([\d.]+)", beat.log())
    assert found, f"{beat!r} never saw its clock jump; log:\n{beat.log_tail()}"
    return float(found.group(1))


@pytest.mark.timeout(120)
@pytest.mark.acceptance_matrix(
    brokers=("redis",), stores=("redis", "postgres"), slow_stores=("redis",)
)
def test_skewed_and_jumping_node_clocks_neither_double_nor_drop_a_slot(
    deployment: Deployment, ledger: Ledger, gate: None
) -> None:
    # Given four beat nodes: two whose clocks differ by 2 s (one 1 s behind the
    # store's, one 1 s ahead), one whose clock jumps an hour ahead mid-run, and one
    # whose clock steps a minute back
    deployment.start_worker(concurrency=4)
    behind, ahead, jumper, stepper = b.start_beats(
        deployment,
        [
            {"EXACTONCE_ACC_CLOCK_OFFSET": "-1"},
            {"EXACTONCE_ACC_CLOCK_OFFSET": "1"},
            {
                "EXACTONCE_ACC_CLOCK_JUMP": str(JUMP),
                "EXACTONCE_ACC_CLOCK_JUMP_AFTER": str(JUMP_AFTER),
            },
            {
                "EXACTONCE_ACC_CLOCK_JUMP": str(STEP_BACK),
                "EXACTONCE_ACC_CLOCK_JUMP_AFTER": str(JUMP_AFTER),
            },
        ],
        entries=ENTRIES,
    )
    started = b.store_now(deployment)
    window_start = max(started, b.claim_floor(deployment)) + timedelta(seconds=START_MARGIN)

    # When they tick together for half a minute
    nodes = [behind, ahead, jumper, stepper]
    b.run_until(deployment, started + timedelta(seconds=CLOCK_RUN), nodes)
    for beat in nodes:
        beat.kill()
    stopped = b.store_now(deployment)

    # Then the skews were real: every record each beat logged bears its node clock
    for beat, offset in ((behind, -1.0), (ahead, 1.0)):
        skews = [skew for _, skew in _skews(beat)]
        assert skews and all(abs(skew - offset) < 0.05 for skew in skews), (beat, skews[:5])
        assert f"{CLOCK_MARK} offset {offset:+g} s" in beat.log()
    window_end = stopped - timedelta(seconds=END_MARGIN)
    for beat, jump in ((jumper, JUMP), (stepper, STEP_BACK)):
        jumped = _jumped_at(beat)
        # (a record whose time was read while the jump took effect may be either)
        before = [skew for real, skew in _skews(beat) if real < jumped - 0.05]
        after = [skew for real, skew in _skews(beat) if real > jumped + 0.05]
        assert before and all(abs(skew) < 0.05 for skew in before), before[:5]
        assert after and all(abs(skew - jump) < 0.05 for skew in after), after[:5]
        # ... the jump happened inside the measured window
        assert window_start.timestamp() + 1 < jumped < window_end.timestamp() - 5
        # ... and the node kept claiming after it (with four nodes racing for each slot,
        # one may lose every slot for a while)
        assert b.claims_by(beat, after_real=jumped) > 0, beat.log_tail()
    assert b.claims_by(behind) > 0 and b.claims_by(ahead) > 0
    # ... and every slot of the window ran exactly once, none anywhere twice
    expected = b.slots(b.entry_names(ENTRIES), window_start, window_end)
    assert len(expected) >= ENTRIES * 15
    b.wait_executed(ledger, expected)
    b.assert_each_ran_once(deployment, ledger, expected)
    b.assert_published_once(deployment, expected)


# --- store loss -------------------------------------------------------------------------------

#: Seconds of claims before the store is killed, from the claim floor.
LOSS_BEFORE = 8
#: Seconds of store time the beats run for once the new store's claim floor has passed.
LOSS_AFTER = 10


@contextlib.contextmanager
def _private_redis() -> Iterator[RedisServer]:
    """A private redis-server (no persistence) on a free port: started, and killed at the end."""
    if shutil.which("redis-server") is None and services.required():
        pytest.fail("redis-server is not installed and EXACTONCE_REQUIRE_SERVICES is set")
    with redis_server() as server:  # skips when redis-server is missing
        yield server


def _events_after(beats: list[BeatProcess], action: str, real: float) -> list[dict[str, Any]]:
    return [event for beat in beats for event in beat.events(action) if event["real"] > real]


#: The scheduler's per-entry skip record (``slot_skipped_entry``, at debug): the slots
#: are in its message only (a structured ``first``/``last`` would spare this parse).
_ENTRY_SKIP = re.compile(
    r"^(?P<entry>\S+): (?P<n>\d+) slot\(s\) from (?P<first>\S+) to (?P<last>\S+) "
)


def _skip_count(event: dict[str, Any]) -> int:
    """Slots a ``slot_skipped`` event counted (its ``count`` is not a log field: the message)."""
    if "count" in event:
        return int(event["count"])
    found = re.match(r"^(\d+) slot\(s\) skipped", event["message"])
    assert found, f"unexpected slot_skipped message: {event['message']!r}"
    return int(found.group(1))


def _skipped_slots(beats: list[BeatProcess], where: str, after_real: float) -> set[b.Occurrence]:
    """Every ``(entry, fire_time)`` some beat logged as skipped for ``where`` after a time."""
    slots: set[b.Occurrence] = set()
    for event in _events_after(beats, "slot_skipped_entry", after_real):
        if event.get("where") != where:
            continue
        found = _ENTRY_SKIP.match(event["message"])
        assert found, f"unexpected slot_skipped_entry message: {event['message']!r}"
        first = datetime.fromisoformat(found["first"])
        last = datetime.fromisoformat(found["last"])
        slots |= b.slots([found["entry"]], first, last)
    return slots


@pytest.mark.timeout(120)
@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis",))
def test_redis_store_restarted_empty_mid_run_runs_no_slot_twice(
    deployment: Deployment, ledger: Ledger, gate: None
) -> None:
    entries = b.entry_names(ENTRIES)
    with _private_redis() as server:
        deployment.store_url = server.url  # the broker stays on the shared Redis
        try:
            # Given three beats claiming every-second slots in a private Redis store
            deployment.start_worker(concurrency=4)
            beats = b.start_beats(deployment, [{}, {}, {}], entries=ENTRIES)
            started = b.store_now(deployment)
            window_start = max(started, b.claim_floor(deployment)) + timedelta(seconds=START_MARGIN)
            b.run_until(deployment, window_start + timedelta(seconds=LOSS_BEFORE), beats)
            killed_at = b.store_now(deployment)

            # When the store is SIGKILLed, and (once every beat has failed a
            # tick on it) starts again empty
            server.kill()
            killed_real = time.time()
            poll(
                lambda: all(_events_after([beat], "fail_closed", killed_real) for beat in beats),
                timeout=15,
            )
            server.start()
            restarted = b.store_now(deployment)  # the same machine clock as before
            restarted_real = time.time()

            # Then runs resume once the new store's claim floor has passed. The
            # epoch is re-created by the first beat whose claim it refuses (read
            # it only then: reading it creates an absent one)
            poll(lambda: any(b.dispatched_by(beat, restarted_real) for beat in beats), timeout=30)
            floor = b.claim_floor(deployment)
            assert floor > restarted, (floor, restarted)  # a new epoch, born after the restart
            resumed_from = floor + timedelta(seconds=START_MARGIN)
            b.run_until(deployment, resumed_from + timedelta(seconds=LOSS_AFTER), beats)
            for beat in beats:
                beat.kill()
            stopped = b.store_now(deployment)
            before = b.slots(entries, window_start, killed_at - timedelta(seconds=END_MARGIN))
            after = b.slots(entries, resumed_from, stopped - timedelta(seconds=END_MARGIN))
            b.wait_executed(ledger, before | after)

            # ... no slot ran twice, before, across or after the loss
            b.assert_no_duplicates(ledger)
            # ... every slot ran once before the loss, and once after it (the new life)
            b.assert_each_ran_once(deployment, ledger, before)
            b.assert_each_ran_once(deployment, ledger, after)
            # ... what did not run lies between the kill and the new floor: the loss
            # costs the slots that cannot be proven unclaimed, and no others
            ran = set(ledger.occurrences())
            first_run = min(fire for _, fire in ran)
            lost = b.slots(entries, first_run, stopped - timedelta(seconds=END_MARGIN)) - ran
            assert lost, "the loss cost no slot: was the store really emptied?"
            lost_fires = sorted({fire for _, fire in lost})
            assert killed_at - timedelta(seconds=END_MARGIN) < lost_fires[0], lost_fires
            assert lost_fires[-1] <= floor, (lost_fires, floor)
        finally:
            deployment.close()  # while the private store is still up

    # ... and every beat saw the loss and counted the slots it skipped for it; every
    # slot lost after the kill (never claimed in the old life: due-ness is judged on
    # the store's clock) is among those some beat counted
    for beat in beats:
        detected = _events_after([beat], "store_loss_detected", killed_real)
        assert detected, f"{beat!r} did not detect the loss; log:\n{beat.log_tail()}"
        reported = [
            event
            for event in _events_after([beat], "slot_skipped", killed_real)
            if event.get("where") == "store_loss"
        ]
        assert sum(_skip_count(event) for event in reported) > 0, beat.log_tail()
    counted = _skipped_slots(beats, "store_loss", killed_real)
    uncounted = {(entry, fire) for entry, fire in lost if fire > killed_at} - counted
    assert not uncounted, f"lost and never counted as skipped: {sorted(uncounted)[:5]}"
