"""examples/django_project runs as its README says: two beats and a worker, each run once.

The example is copied to a temporary folder (its SQLite database is made
there), migrated, and run for a few occurrences of its periodic task; then its
own check, ``manage.py report_runs``, must pass: no occurrence ran twice, and
the row's ``total_run_count`` is the number of runs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import services
from tests.acceptance.harness import REPO_ROOT, CeleryProcess, poll, process_env

EXAMPLE = REPO_ROOT / "examples" / "django_project"
#: The broker's Redis database: this test's alone, emptied before and after.
BROKER_DB = 12
RUNS = 3


class ShopProcess(CeleryProcess):
    """``celery -A shop <args>`` of the example, its output in ``log_path``."""

    app_module = "shop"

    def __init__(self, env: dict[str, str], log_path: Path, *args: str) -> None:
        self.env, self.log_path, self.args = env, log_path, args
        self.proc = None

    @property
    def argv(self) -> list[str]:
        return self.celery(*self.args)


def manage(env: dict[str, str], where: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.timeout(180)
def test_the_example_runs_its_periodic_task_once_per_occurrence_on_two_beats(
    tmp_path: Path,
) -> None:
    services.need("redis")
    broker = services.REDIS_URL.rsplit("/", 1)[0] + f"/{BROKER_DB}"
    services.delete_redis_keys(broker, "*")
    shop = tmp_path / "django_project"
    shutil.copytree(EXAMPLE, shop)
    env = process_env(SHOP_BROKER_URL=broker, SHOP_DATABASE=str(shop / "db.sqlite3"))
    env["PYTHONPATH"] = f"{shop}:{env['PYTHONPATH']}"
    # Given the example, migrated as its README says
    migrated = manage(env, shop, "migrate", "-v", "0")
    assert migrated.returncode == 0, migrated.stderr
    # When a worker and two beats run it
    processes = [
        ShopProcess(env, tmp_path / "worker.log", "worker", "-c", "2", "--loglevel", "INFO"),
        ShopProcess(env, tmp_path / "beat-1.log", "beat", "-s", str(tmp_path / "b1")),
        ShopProcess(env, tmp_path / "beat-2.log", "beat", "-s", str(tmp_path / "b2")),
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
        services.delete_redis_keys(broker, "*")
    # Then its own check passes: each occurrence once, and the admin counts them
    checked = manage(env, shop, "report_runs")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    summary = json.loads(checked.stdout)
    assert summary["ran_twice"] == []
    assert summary["runs"] == summary["occurrences"] == summary["total_run_count"] >= RUNS
