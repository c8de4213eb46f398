"""``celery exactonce probe beat|worker``: the answer of a live endpoint, of none, and bad usage.

The command runs as users run it (``python -m celery -A tests.cli.cli_app``),
against an endpoint this test serves with fixed verdicts; the acceptance test
of ``examples/deploy`` asks a real beat and worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from celery_exactonce.observe.health import Verdict
from tests.cli.conftest import APP, COMMAND_TIMEOUT, REPO_ROOT
from tests.integration.servers import free_port
from tests.support import probes


def probe(*args: str, **conf: object) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXACTONCE_CLI_")}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
        EXACTONCE_CLI_STORE_URL="redis://127.0.0.1:1/0",  # never opened by the probe
        EXACTONCE_CLI_CONF=json.dumps(conf),
    )
    argv = [sys.executable, "-m", "celery", "-A", APP, "exactonce", "probe", *args]
    return subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=False
    )


@pytest.fixture
def served() -> Iterator[int]:
    with probes.served(Verdict(True, "ticking"), Verdict(False, "the store is down")) as port:
        yield port


def test_probe_asks_the_port_of_the_roles_setting(served: int) -> None:
    done = probe("beat", exactonce_metrics_port=served)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"beat liveness (127.0.0.1:{served}/healthz): ok: ticking\n"
    done = probe("worker", "--ready", exactonce_worker_metrics_port=served)
    assert done.returncode == 1, done.stderr
    assert done.stdout.endswith("/readyz): failing: the store is down\n")


def test_probe_json_says_what_it_asked_and_the_answer(served: int) -> None:
    done = probe("worker", "--json", "--ready", "--port", str(served), "--host", "127.0.0.1")
    assert done.returncode == 1, done.stderr
    assert json.loads(done.stdout) == {
        "ok": False,
        "role": "worker",
        "probe": "ready",
        "url": f"127.0.0.1:{served}/readyz",
        "status": 503,
        "answer": "failing: the store is down",
    }


def test_probe_of_a_port_nothing_answers_on_fails() -> None:
    port = free_port()
    done = probe("beat", exactonce_metrics_port=port, exactonce_metrics_addr="::")
    assert done.returncode == 1
    # "::" takes IPv4 too: 127.0.0.1 first, then ::1 (the last one tried is named)
    assert done.stdout.startswith(f"beat liveness ([::1]:{port}/healthz): failing: nothing answers")


def test_probe_without_a_port_is_a_usage_error_naming_the_setting() -> None:
    done = probe("worker")
    assert done.returncode == 2
    assert "exactonce_worker_metrics_port is not set" in done.stderr
    assert probe("scheduler").returncode == 2  # not a role
