"""examples/quickstart runs as its README says: a worker and two beats, each tick once.

The example is copied to a temporary folder and run from there, as the README
says: ``celery -A proj exactonce check``, a worker, two beats, then
``celery -A proj exactonce status --json`` and ``jobs --json``. Its broker and
store are two Redis databases of this test's own (``PROJ_BROKER_URL``,
``PROJ_STORE_URL``), its ``tick`` comes every 2 seconds (``PROJ_TICK_EVERY``),
and each run appends a line to a ledger file (``PROJ_LEDGER``): no occurrence
may run twice, nor be sent by both beats, and the store must agree with the
ledger.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.examples import (
    ExampleProcess,
    copy_example,
    empty_redis,
    fresh_redis,
    run_in,
)
from tests.acceptance.harness import poll, process_env

#: The broker's and the store's Redis databases: this test's alone, emptied before and after.
BROKER_DB, STORE_DB = 13, 14
RUNS = 3
#: What a beat logs for each occurrence it sent (docs/quickstart.md, step 4).
SENT = re.compile(r"Sending due task tick \(proj\.tick\) key=tick fire_time=(\S+)")


def proj(env: dict[str, str], where: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``celery -A proj <args>`` from the example's folder, to its end."""
    return run_in(where, env, "-m", "celery", "-A", "proj", *args)


def ledger_runs(path: Path) -> list[dict[str, Any]]:
    """The runs the tasks appended to the ledger (a line being written is left for later)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.endswith("\n")]


@pytest.mark.timeout(90)
def test_the_quickstart_runs_each_tick_once_on_two_beats(tmp_path: Path) -> None:
    broker, store = fresh_redis(BROKER_DB, STORE_DB)
    where = copy_example("quickstart", tmp_path)
    ledger = tmp_path / "ledger.jsonl"
    env = process_env(
        PROJ_BROKER_URL=broker,
        PROJ_STORE_URL=store,
        PROJ_TICK_EVERY="2",
        PROJ_LEDGER=str(ledger),
    )
    # Given the set-up checked as the README says (a new store: the schema warns, no failure)
    checked = proj(env, where, "exactonce", "check")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "all checks passed" in checked.stdout
    # When a worker and two beats run it
    worker = ExampleProcess(
        "proj", env, where, tmp_path / "worker.log", "worker", "--loglevel", "INFO"
    )
    beats = [
        ExampleProcess("proj", env, where, tmp_path / f"beat-{n}.log", "beat", "--loglevel", "INFO")
        for n in (1, 2)
    ]
    processes = [worker, *beats]
    try:
        for process in processes:
            process.start()

        def ticks() -> int:
            for process in processes:
                assert process.alive(), process.log_tail()
            return sum(run["task"] == "proj.tick" for run in ledger_runs(ledger))

        poll(lambda: ticks() >= RUNS, timeout=60, interval=0.5)
        for process in processes:
            process.kill()
        # Then the README's commands say what ran, and it ran once per occurrence
        status = proj(env, where, "exactonce", "status", "--json")
        listed = proj(env, where, "exactonce", "jobs", "--task", "proj.tick", "--json")
    finally:
        for process in processes:
            process.kill()
        empty_redis([broker, store])
    assert status.returncode == 0, status.stdout + status.stderr
    assert listed.returncode == 0, listed.stdout + listed.stderr
    runs = [run for run in ledger_runs(ledger) if run["task"] == "proj.tick"]
    keys = Counter(run["idempotency_key"] for run in runs)
    assert [key for key, n in keys.items() if n > 1] == [], runs
    assert len(Counter(run["fire_time"] for run in runs)) == len(runs) >= RUNS
    assert all(run["entry"] == "tick" for run in runs), runs
    # Each occurrence was sent by one beat: none appears in both beats' logs
    sent = [Counter(SENT.findall(beat.log())) for beat in beats]
    assert all(n == 1 for counts in sent for n in counts.values()), sent
    assert set(sent[0]) & set(sent[1]) == set(), sent
    # The store agrees: every run's job is there, each SUCCEEDED tick job ran once
    jobs = {job["task_id"]: job for job in json.loads(listed.stdout)["jobs"]}
    assert listed.stdout and json.loads(listed.stdout)["next_cursor"] is None
    assert {run["task_id"] for run in runs} <= set(jobs), (runs, jobs)
    succeeded = {task_id for task_id, job in jobs.items() if job["state"] == "SUCCEEDED"}
    assert len(succeeded) >= RUNS
    assert succeeded <= {run["task_id"] for run in runs}
    assert all(jobs[run["task_id"]]["fire_time"] for run in runs)
    counts = json.loads(status.stdout)["jobs"]
    assert counts["SUCCEEDED"] >= len(succeeded)
    assert counts["FAILED"] == counts["TIMEOUT"] == 0, counts
