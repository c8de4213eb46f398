"""A misspelt ``exactonce_*`` setting, in both forms users write (SCENARIOS 79).

``exactonce_tick_intervall`` on a Celery app, ``CELERY_EXACTONCE_TICK_INTERVALL``
in a Django project's settings (``tests/cli/misspelt_app.py``): ``celery
exactonce check`` fails naming it and the setting meant, and a real ``celery
beat`` and ``celery worker`` start (an unknown setting is ignored) with a
warning that names both and points at the file and line of the typo, not at
library code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.acceptance.harness import BEAT_STARTED, REPO_ROOT, CeleryProcess, poll

pytestmark = pytest.mark.timeout(60)

APP = "tests.cli.misspelt_app"
#: (form, the key as written, the setting meant, the file that writes the key)
FORMS = [
    pytest.param(
        "plain",
        "exactonce_tick_intervall",
        "exactonce_tick_interval",
        REPO_ROOT / "tests" / "cli" / "misspelt_app.py",
        id="plain",
    ),
    pytest.param(
        "django",
        "CELERY_EXACTONCE_TICK_INTERVALL",
        "CELERY_EXACTONCE_TICK_INTERVAL",
        REPO_ROOT / "tests" / "cli" / "misspelt_settings.py",
        id="django",
    ),
]


def environment(form: str) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("EXACTONCE_") and key != "DJANGO_SETTINGS_MODULE"
    }
    pythonpath = [str(REPO_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update(PYTHONPATH=os.pathsep.join(pythonpath), PYTHONUNBUFFERED="1")
    env["EXACTONCE_S79_FORM"] = form
    return env


def line_of(path: Path, key: str) -> int:
    """The line of ``path`` that sets ``key`` (the typo's own line)."""
    (number,) = [
        n for n, text in enumerate(path.read_text().splitlines(), 1) if f"{key} = " in text
    ]
    return number


@pytest.mark.parametrize(("form", "key", "meant", "source"), FORMS)
def test_scenario_79_check_fails_on_a_misspelt_setting_naming_the_one_meant(
    form: str, key: str, meant: str, source: Path
) -> None:
    """Before the fix, ``check`` said "all checks passed": the typo was never looked at."""
    argv = [sys.executable, "-m", "celery", "-A", APP, "exactonce", "check"]
    env = environment(form)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAIL")]
    assert len(failed) == 1, done.stdout
    assert key in failed[0] and f"did you mean {meant!r}?" in failed[0], failed[0]
    assert "all checks passed" not in done.stdout

    done = subprocess.run(
        [*argv, "--json"], env=env, capture_output=True, text=True, timeout=30, check=False
    )
    data = json.loads(done.stdout)
    (refused,) = [c for c in data["checks"] if c["status"] == "FAIL"]
    assert (refused["name"], refused["setting"]) == ("setting names", key), refused
    assert data["ok"] is False


class Node(CeleryProcess):
    """``celery -A misspelt_app beat -S exactonce`` or ``worker -P solo`` (all in memory)."""

    app_module = APP

    def __init__(self, role: str, env: dict[str, str], directory: Path) -> None:
        self.role = role
        self.env = env
        self.directory = directory
        self.log_path = directory / f"{role}.log"
        self.proc = None

    @property
    def argv(self) -> list[str]:
        if self.role == "worker":
            return self.celery(
                "worker",
                "-P",
                "solo",
                "--without-heartbeat",
                "--without-mingle",
                "--without-gossip",
                "--loglevel",
                "INFO",
            )
        schedule = str(self.directory / "celerybeat-schedule")
        return self.celery("beat", "-S", "exactonce", "-s", schedule, "--loglevel", "INFO")

    def started(self) -> bool:
        log = self.log()
        if self.role == "worker":
            return any(line.rstrip().endswith(" ready.") for line in log.splitlines())
        return BEAT_STARTED in log


@pytest.mark.parametrize("role", ["beat", "worker"])
@pytest.mark.parametrize(("form", "key", "meant", "source"), FORMS)
def test_scenario_79_beat_and_worker_warn_at_the_typo_with_the_setting_meant(
    form: str, key: str, meant: str, source: Path, role: str, tmp_path: Path
) -> None:
    """Before the fix, the warning pointed at celery_exactonce's own code and listed
    every known setting rather than the one meant."""
    node = Node(role, environment(form), tmp_path).start()
    try:
        # When the node starts with the typo: it starts (the setting is ignored), and warns
        def warned() -> str | None:
            lines = [line for line in node.log().splitlines() if "UnknownSettingWarning" in line]
            return lines[0] if lines and node.started() else None

        try:
            line = poll(warned, timeout=20.0, interval=0.1)
        except AssertionError:
            raise AssertionError(f"no warning once {role} started; log:\n{node.log()}") from None
        assert node.alive(), node.log()
    finally:
        node.kill()

    # Then the warning names the key and the setting meant, at the typo's file and line
    assert f"{key!r}" in line and f"did you mean {meant!r}?" in line, line
    assert line.startswith(f"{source}:{line_of(source, key)}: "), line
    assert "celery_exactonce" not in line.split(": ", 1)[0], line
