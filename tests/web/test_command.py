"""``celery -A APP exactonce web``: what it refuses before it starts, and what it serves.

The command runs as a user runs it (``python -m celery``, a real process on a
spare port, :class:`tests.web.process.WebProcess`), on the CLI tests' app
(:mod:`tests.cli.cli_app`) and a SQLite store set up in the test's directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from celery_exactonce.cli import exactonce
from celery_exactonce.stores import store_from_url
from tests.support.helpers import task_job
from tests.web.process import REPO_ROOT, WebProcess

pytestmark = pytest.mark.timeout(90)

APP = "tests.cli.cli_app"
TOKEN = "t0ken-0f-the-command"


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """The environment of the command: the CLI app on a SQLite store set up, one job in it."""
    url = f"sqlite:///{tmp_path / 'web.db'}"
    namespace = f"web{uuid.uuid4().hex[:8]}"
    store = store_from_url(url, namespace=namespace)
    store.setup()
    store.create(task_job("job-in-store"))
    store.close()
    names = ("EXACTONCE_CLI_", "EXACTONCE_WEB_")
    base = {k: v for k, v in os.environ.items() if not k.startswith(names)}
    yield {**base, "EXACTONCE_CLI_STORE_URL": url, "EXACTONCE_CLI_NAMESPACE": namespace}


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "celery", "-A", APP, "exactonce", "web", *args]
    env = {**env, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers or {})  # noqa: S310 (http)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:  # noqa: S310
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@pytest.mark.parametrize("bind", ["0.0.0.0", "::", "192.0.2.10"])  # noqa: S104
def test_a_bind_address_not_loopback_without_auth_is_refused_in_one_line(
    env: dict[str, str], bind: str
) -> None:
    done = run(env, "--bind", bind)
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(
        f"celery-exactonce: error: refusing to serve the dashboard on {bind}, which is not "
        "this machine alone, without auth: set EXACTONCE_WEB_TOKEN"
    )


def test_auth_that_cannot_work_is_a_usage_error(env: dict[str, str]) -> None:
    done = run(env, "--user", "op")
    assert done.returncode == 2
    assert "basic auth needs both a user and a password" in done.stderr


def test_without_the_web_extra_the_command_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    result = CliRunner().invoke(exactonce, ["web"])
    assert result.exit_code == 1
    assert result.output == (
        "celery-exactonce: error: the dashboard needs an optional dependency (uvicorn): "
        "pip install 'celery-exactonce[web]'\n"
    )


def test_the_command_serves_the_dashboard_on_loopback_to_loopback_names_only(
    env: dict[str, str], tmp_path: Path
) -> None:
    web = WebProcess(APP, env, tmp_path / "web.log").start()
    try:
        web.wait_ready()
        status, page = get(f"{web.url}/jobs")
        assert status == 200 and "job-in-store" in page
        # A page asked for under another host name (DNS rebinding) is refused
        status, page = get(f"{web.url}/jobs", {"Host": f"rebound.example:{web.port}"})
        assert status == 400 and "job-in-store" not in page
    finally:
        web.stop()
    assert "Finished server process" in web.log()  # SIGTERM: a clean stop (uvicorn's)
    assert "dashboard on http://127.0.0.1:" in web.log()
    assert "actions off; auth off" in web.log()


def test_with_a_token_from_the_environment_it_asks_for_it_and_never_prints_it(
    env: dict[str, str], tmp_path: Path
) -> None:
    env = {**env, "EXACTONCE_WEB_TOKEN": TOKEN}
    web = WebProcess(APP, env, tmp_path / "web.log", ["--actions"]).start()
    try:
        web.wait_ready()
        assert get(f"{web.url}/jobs")[0] == 401
        status, page = get(f"{web.url}/jobs", {"Authorization": f"Bearer {TOKEN}"})
        assert status == 200 and "job-in-store" in page
    finally:
        web.stop()
    assert "actions on; auth on" in web.log()
    assert TOKEN not in web.log()


def test_a_store_never_set_up_stops_it_with_the_line_that_says_to_migrate(
    env: dict[str, str], tmp_path: Path
) -> None:
    env = {**env, "EXACTONCE_CLI_STORE_URL": f"sqlite:///{tmp_path / 'never.db'}"}
    done = run(env)
    assert done.returncode == 1
    assert "was never set up" in done.stderr and "exactonce migrate" in done.stderr
