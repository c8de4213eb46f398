"""A user's test suite on the pytest plugin's fixtures alone passes (issue 16, item 5).

Real ``pytest`` runs, as a user's (the plugin from its ``pytest11`` entry point):

* examples/testing, a project tested with the plugin's fixtures only, passes
  in eager mode and with an in-process worker, with pytest-celery's plugin
  loaded and with ``celery.contrib.pytest`` alone;
* "ran once" can fail: a suite whose task ran twice fails, saying so;
* the fixtures come from the entry point (``-p no:celery_exactonce`` removes
  them), and sit beside ``celery.contrib.pytest``'s in one session.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "testing"
#: The example suite's tests, all of which must pass.
EXAMPLE_TESTS = 8
#: pytest-celery's plugin is named ``celery`` (and imports celery.contrib.pytest);
#: without it, celery.contrib.pytest by itself.
PLUGIN_SETS = {
    "pytest-celery": [],
    "celery.contrib.pytest": ["-p", "no:celery", "-p", "celery.contrib.pytest"],
}


def run_pytest(cwd: Path, *args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    """``python -m pytest`` in ``cwd`` as a user runs it (the plugin from its entry point)."""
    registered = any(
        ep.name == "celery_exactonce" for ep in metadata.entry_points(group="pytest11")
    )
    plugin = [] if registered else ["-p", "celery_exactonce.testing"]  # a bare checkout
    # Not CI's output either: under CI (or BUILD_NUMBER) pytest repeats each failure's
    # whole message in its short summary, and the counts below are of one report.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PYTEST_") and k not in ("CI", "BUILD_NUMBER")
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
    )


# -- a user's suite, run by pytest ------------------------------------------------------------


@pytest.mark.parametrize("plugins", list(PLUGIN_SETS), ids=list(PLUGIN_SETS))
@pytest.mark.parametrize("mode", ["eager", "worker"])
def test_the_example_suite_passes_on_the_plugins_fixtures_alone(mode: str, plugins: str) -> None:
    result = run_pytest(EXAMPLE, f"--exactonce-mode={mode}", *PLUGIN_SETS[plugins])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{EXAMPLE_TESTS} passed" in result.stdout


RAN_TWICE = """
from celery import shared_task

from celery_exactonce import ExactOnceTask


@shared_task(base=ExactOnceTask, name="t.twice")
def twice():
    return "ran"


def test_the_task_ran_twice(exactonce_jobs):
    twice.delay()
    twice.delay()
    exactonce_jobs.assert_ran_once(twice)
"""


@pytest.mark.parametrize("mode", ["eager", "worker"])
def test_a_task_that_ran_twice_fails_the_ran_once_assertion(tmp_path: Path, mode: str) -> None:
    (tmp_path / "test_twice.py").write_text(RAN_TWICE, encoding="utf-8")
    result = run_pytest(tmp_path, f"--exactonce-mode={mode}")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 failed" in result.stdout
    assert "expected task t.twice to run once; it ran 2 time(s) in 2 job(s)" in result.stdout
    assert result.stdout.count("t.twice: SUCCEEDED at attempt 0") == 2  # each job, described


def test_the_fixtures_come_from_the_plugin(tmp_path: Path) -> None:
    (tmp_path / "test_twice.py").write_text(RAN_TWICE, encoding="utf-8")
    result = run_pytest(tmp_path, "-p", "no:celery_exactonce")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "fixture 'exactonce_jobs' not found" in result.stdout


BESIDE = """
import pytest
from celery import shared_task

from celery_exactonce import ExactOnceTask


@shared_task(base=ExactOnceTask, name="t.gated")
def gated(x):
    return x * 2


@pytest.fixture(scope="session")
def celery_config():
    # celery_app finalizes with every shared task, t.gated too: its worker checks the store.
    return {"exactonce_store_url": "memory://"}


def test_celerys_own_fixtures(celery_app, celery_worker):
    @celery_app.task(name="t.plain")
    def plain(x):
        return x + 1

    celery_worker.reload()
    assert plain.delay(1).get(timeout=10) == 2


def test_ours(exactonce_jobs):
    result = gated.delay(21)
    exactonce_jobs.assert_ran_once(result)
    assert exactonce_jobs.get(result).state == "SUCCEEDED"
"""


def test_the_plugin_runs_beside_celery_contrib_pytest_in_one_session(tmp_path: Path) -> None:
    (tmp_path / "test_beside.py").write_text(BESIDE, encoding="utf-8")
    # Worker mode: celery_worker's worker, then ours, one after the other in one process.
    result = run_pytest(tmp_path, "--exactonce-mode=worker", *PLUGIN_SETS["celery.contrib.pytest"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout
