"""examples/django_project runs as its README says: two beats and a worker, each run once.

The example is copied to a temporary folder (its SQLite database is made
there), migrated, and run for a few occurrences of its periodic task; then its
own check, ``manage.py report_runs``, must pass: no occurrence ran twice, and
the row's ``total_run_count`` is the number of runs.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.acceptance.examples import ExampleProcess, copy_example, empty_redis, fresh_redis, run_in
from tests.acceptance.harness import poll, process_env

#: The broker's Redis database: this test's alone, emptied before and after.
BROKER_DB = 12
RUNS = 3


def manage(env: dict[str, str], where: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_in(where, env, "manage.py", *args, timeout=120)


@pytest.mark.timeout(180)
def test_the_example_runs_its_periodic_task_once_per_occurrence_on_two_beats(
    tmp_path: Path,
) -> None:
    (broker,) = fresh_redis(BROKER_DB)
    shop = copy_example("django_project", tmp_path)
    env = process_env(SHOP_BROKER_URL=broker, SHOP_DATABASE=str(shop / "db.sqlite3"))
    env["PYTHONPATH"] = f"{shop}:{env['PYTHONPATH']}"
    # Given the example, migrated as its README says
    migrated = manage(env, shop, "migrate", "-v", "0")
    assert migrated.returncode == 0, migrated.stderr
    # When a worker and two beats run it
    processes = [
        ExampleProcess(
            "shop", env, shop, tmp_path / "worker.log", "worker", "-c", "2", "--loglevel", "INFO"
        ),
        ExampleProcess(
            "shop", env, shop, tmp_path / "beat-1.log", "beat", "-s", str(tmp_path / "b1")
        ),
        ExampleProcess(
            "shop", env, shop, tmp_path / "beat-2.log", "beat", "-s", str(tmp_path / "b2")
        ),
    ]
    try:
        for process in processes:
            process.start()

        def runs() -> int:
            for process in processes:
                assert process.alive(), process.log_tail()
            checked = manage(env, shop, "report_runs")
            return int(json.loads(checked.stdout or "{}").get("runs", 0)) if checked.stdout else 0

        poll(lambda: runs() >= RUNS, timeout=90, interval=1.0)
    finally:
        for process in processes:
            process.kill()
        empty_redis([broker])
    # Then its own check passes: each occurrence once, and the admin counts them
    checked = manage(env, shop, "report_runs")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    summary = json.loads(checked.stdout)
    assert summary["ran_twice"] == []
    assert summary["runs"] == summary["occurrences"] == summary["total_run_count"] >= RUNS
