"""Two real ``celery beat -S exactonce`` processes and a worker: beat's log, and their metrics.

Each beat logs one INFO "Scheduler: Sending due task" line per occurrence it
dispatched (per the store: the node of the job's ``DISPATCHED`` transition)
and none for the occurrences the other beat dispatched; together their lines
name every occurrence of the window once. Each says once that it started,
and explains the new namespace's epoch guard once, in plain words.

Meanwhile each beat serves ``/metrics`` (``exactonce_metrics_port``) and the
prefork worker serves its children's counters (multiprocess mode): scraped
early in the run and at its end, the counters and gauges have moved.

The run lasts 60 s under ``pytest -m slow`` (``tox -e chaos``); the suite runs
the same test for 20 s (10 every-second entries, some 400 occurrences between
the two beats), which shows the same in a third of the time.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from celery_exactonce.core.states import State
from tests.acceptance import beats as b
from tests.acceptance import scrapes
from tests.acceptance.harness import BeatProcess, Deployment, Ledger, poll
from tests.acceptance.scrapes import Sample, count, jobs

ENTRIES = 10
START_MARGIN = 2
END_MARGIN = 3

#: Celery's log format, then stock beat's line and the occurrence it names.
SEND_LINE = re.compile(
    r"INFO/MainProcess\] Scheduler: Sending due task (?P<entry>\S+) \((?P<task>\S+)\) "
    r"key=(?P=entry) fire_time=(?P<fire>\S+) idempotency_key=(?P<key>eo1_[0-9a-f]+)$"
)


def send_lines(beat: BeatProcess) -> Counter[b.Occurrence]:
    """The occurrences ``beat``'s log has a send line for, with how many lines each."""
    found: Counter[b.Occurrence] = Counter()
    for line in beat.log().splitlines():
        if (match := SEND_LINE.search(line)) is not None:
            fire = datetime.fromisoformat(match["fire"].replace("Z", "+00:00"))
            found[(match["entry"], fire)] += 1
    return found


def dispatcher_of(deployment: Deployment, occurrence: b.Occurrence) -> str | None:
    """The node of the occurrence's ``DISPATCHED`` transition, as the store's record holds it."""
    job = b.job_of(deployment, *occurrence)
    if job is None:
        return None
    nodes = [entry.node for entry in job.history if entry.dst is State.DISPATCHED]
    assert len(nodes) <= 1, (occurrence, job.history)
    return nodes[0] if nodes else None


@pytest.mark.timeout(240)
@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis",))
@pytest.mark.parametrize("run_seconds", [20, pytest.param(60, marks=pytest.mark.slow)])
def test_each_beat_logs_a_send_line_for_exactly_the_occurrences_it_dispatched(
    deployment: Deployment, ledger: Ledger, gate: None, tmp_path: Path, run_seconds: int
) -> None:
    # Given a prefork worker exporting its children's metrics (multiprocess mode)
    ports = distinct_ports(3)
    multiproc = tmp_path / "prometheus-worker"
    multiproc.mkdir()
    deployment.extra_env = {
        "PROMETHEUS_MULTIPROC_DIR": str(multiproc),
        "EXACTONCE_ACC_EXTRA_CONF": metrics_conf(exactonce_worker_metrics_port=ports[0]),
    }
    deployment.start_worker(concurrency=4)
    deployment.extra_env = {}
    # ... and two beats of the same 10 every-second entries on a new namespace, each
    # serving /metrics
    envs = [{"EXACTONCE_ACC_EXTRA_CONF": metrics_conf(exactonce_metrics_port=p)} for p in ports[1:]]
    beats = b.start_beats(deployment, envs, entries=ENTRIES)
    started = b.store_now(deployment)
    floor = b.claim_floor(deployment)
    first = {port: scrapes.scrape_until(port, bool) for port in ports}
    # When they run for run_seconds
    b.run_until(deployment, started + timedelta(seconds=run_seconds), beats)
    assert_metrics_moved(first, ports[0], dict(zip(ports[1:], beats, strict=True)))
    for beat in beats:
        beat.kill()
    stopped = b.store_now(deployment)
    window = b.slots(
        b.entry_names(ENTRIES),
        max(started, floor) + timedelta(seconds=START_MARGIN),
        stopped - timedelta(seconds=END_MARGIN),
    )
    assert len(window) >= ENTRIES * (run_seconds - 10)
    b.wait_executed(ledger, window)
    b.assert_each_ran_once(deployment, ledger, window)

    # Then each beat's send lines name exactly the occurrences of the window it dispatched
    dispatchers = {occurrence: dispatcher_of(deployment, occurrence) for occurrence in window}
    lines = {beat.node: send_lines(beat) for beat in beats}
    for beat in beats:
        mine = {occurrence for occurrence, node in dispatchers.items() if node == beat.node}
        logged = set(lines[beat.node]) & window
        assert mine, f"{beat!r} dispatched nothing:\n{beat.log_tail()}"
        assert logged == mine, (
            f"{beat!r}: {len(mine - logged)} dispatched without a line "
            f"{sorted(mine - logged)[:3]}, {len(logged - mine)} lines for another's "
            f"{sorted(logged - mine)[:3]}"
        )
    # ... one line per occurrence in the whole run, in one beat's log only
    every_line = Counter[b.Occurrence]()
    for counted in lines.values():
        every_line.update(counted)
    assert max(every_line.values()) == 1
    assert window <= set(every_line)

    # ... and each beat said once that it started, and explained the epoch guard once
    for beat in beats:
        log = beat.log()
        assert log.count(f"celery-exactonce beat node {beat.node} started: store ") == 1, log
        assert log.count("INFO/MainProcess] The store's epoch began at") == 1, log
        assert "slot(s) skipped (at or before the store epoch" not in info_lines(log)


def info_lines(log: str) -> str:
    """The lines of a beat's log at INFO and above (the ledger app logs ours at debug too)."""
    return "\n".join(line for line in log.splitlines() if "DEBUG/" not in line)


def distinct_ports(count: int) -> list[int]:
    """``count`` different free ports."""
    found: set[int] = set()
    poll(lambda: found.add(scrapes.free_port()) or len(found) >= count, timeout=10, interval=0)
    return sorted(found)[:count]


def metrics_conf(**settings: int) -> str:
    return json.dumps({**settings, "exactonce_metrics_addr": "127.0.0.1"})


def assert_metrics_moved(
    first: dict[int, dict[Sample, float]], worker: int, beats: dict[int, BeatProcess]
) -> None:
    """Scraped again, every beat's and the worker's counters and gauges have moved."""

    def completed(samples: dict[Sample, float]) -> float:
        return count(samples, "completed", state="SUCCEEDED")

    def claims(samples: dict[Sample, float]) -> float:  # won, or found taken
        return count(samples, "dispatched") + count(samples, "slot_already_claimed")

    for port, beat in beats.items():
        tick = ("exactonce_beat_last_tick_timestamp_seconds", (("node", beat.node),))
        before = first[port]

        def moved(
            s: dict[Sample, float], before: dict[Sample, float] = before, tick: Sample = tick
        ) -> bool:
            return (
                s.get(tick, 0) > before.get(tick, 0)
                and s.get(jobs("SUCCEEDED"), 0) > before.get(jobs("SUCCEEDED"), 0)
                and claims(s) > claims(before)
            )

        scrapes.scrape_until(port, moved)
    scrapes.scrape_until(worker, lambda s: completed(s) > completed(first[worker]))
