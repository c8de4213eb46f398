"""examples/deploy runs as its recipes say, and its probes answer for a live beat and worker.

The example is copied to a temporary folder. Its two systemd units' commands
run from there (``ExecStart``, with the units' ``Environment``; the units
pass ``systemd-analyze verify`` once their paths are this machine's); the
container's ``HEALTHCHECK`` command, for the worker and for beat, exits 0
once both are up; every ``httpGet`` probe of the Kubernetes manifest answers
200. Then the store's Redis (a server of this test's own) is killed: beat
and the worker stay live, and neither is ready, each saying why.
"""

from __future__ import annotations

import configparser
import shlex
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.acceptance.examples import ExampleProcess, copy_example, empty_redis, fresh_redis, run_in
from tests.acceptance.harness import REPO_ROOT, poll, process_env
from tests.integration.redis_server import redis_server
from tests.integration.servers import free_port

#: The broker's Redis database: this test's alone, emptied before and after.
BROKER_DB = 3
#: Where the recipes install the project, and the ports ``proj.py`` defaults to.
INSTALLED = "/srv/proj"
BEAT_PORT, WORKER_PORT = 9808, 9809


def unit(path: Path) -> tuple[list[str], dict[str, str]]:
    """A systemd unit's ``ExecStart`` (split) and ``Environment`` settings."""
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    text = path.read_text(encoding="utf-8")
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("Environment="):
            name, _, value = line.removeprefix("Environment=").partition("=")
            env[name] = value
    parser.read_string(text)
    return shlex.split(parser["Service"]["ExecStart"]), env


def healthcheck(path: Path) -> list[str]:
    """The ``HEALTHCHECK … CMD`` command of a Dockerfile (continuation lines joined)."""
    text = path.read_text(encoding="utf-8").replace("\\\n", " ")
    (line,) = [line for line in text.splitlines() if line.startswith("HEALTHCHECK")]
    return shlex.split(line.partition(" CMD ")[2])


def http_probes(path: Path) -> list[tuple[str, str, int]]:
    """Every ``httpGet`` probe of the manifest: ``(container, path, port)``."""
    found = []
    for document in yaml.safe_load_all(path.read_text(encoding="utf-8")):
        for container in document["spec"]["template"]["spec"]["containers"]:
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                get = container.get(kind, {}).get("httpGet")
                if get is not None:
                    found.append((container["name"], get["path"], int(get["port"])))
    return found


def celery_args(argv: list[str]) -> list[str]:
    """What follows ``celery -A proj`` in a recipe's command."""
    assert Path(argv[0]).name == "celery", argv
    assert argv[1:3] == ["-A", "proj"], argv
    return argv[3:]


def until(check: Any, timeout: float, what: str) -> None:
    """Poll ``check`` (every half second) until it holds; else fail naming ``what``."""
    try:
        poll(check, timeout=timeout, interval=0.5)
    except AssertionError:
        raise AssertionError(f"not within {timeout} s: {what}") from None


def status(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
            return reply.status, reply.read().decode().strip()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode().strip()
    except OSError as exc:
        return 0, str(exc)


def verify_units(where: Path, tmp_path: Path) -> None:
    """``systemd-analyze verify`` of each unit, its paths this machine's."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed: the units' syntax is not checked")
    celery = Path(sys.executable).with_name("celery")
    for name in ("exactonce-beat.service", "exactonce-worker.service"):
        text = (where / name).read_text(encoding="utf-8")
        text = text.replace(f"{INSTALLED}/venv/bin/celery", str(celery))
        text = text.replace(INSTALLED, str(where))
        (tmp_path / name).write_text(text, encoding="utf-8")
        done = subprocess.run(
            [analyze, "verify", str(tmp_path / name)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr


@pytest.mark.timeout(150)
def test_the_deploy_recipes_probe_a_live_beat_and_worker(tmp_path: Path) -> None:
    (broker,) = fresh_redis(BROKER_DB)
    where = copy_example("deploy", tmp_path)
    ports = {BEAT_PORT: free_port(), WORKER_PORT: free_port()}
    multiproc = tmp_path / "run" / "exactonce-worker"
    multiproc.mkdir(parents=True)
    processes: dict[str, ExampleProcess] = {}
    with redis_server() as store:
        env = process_env(
            PROJ_BROKER_URL=broker,
            PROJ_STORE_URL=store.url,
            PROJ_METRICS_PORT=str(ports[BEAT_PORT]),
            PROJ_WORKER_METRICS_PORT=str(ports[WORKER_PORT]),
        )
        try:
            for role in ("beat", "worker"):
                argv, unit_env = unit(where / f"exactonce-{role}.service")
                assert {"PROJ_BROKER_URL", "PROJ_STORE_URL"} <= set(unit_env)
                role_env = {**env}
                if "PROMETHEUS_MULTIPROC_DIR" in unit_env:  # systemd's RuntimeDirectory
                    assert unit_env["PROMETHEUS_MULTIPROC_DIR"] == "/run/exactonce-worker"
                    role_env["PROMETHEUS_MULTIPROC_DIR"] = str(multiproc)
                log = tmp_path / f"{role}.log"
                processes[role] = ExampleProcess(
                    "proj", role_env, where, log, *celery_args(argv)
                ).start()
            check = celery_args(healthcheck(where / "Dockerfile"))
            assert check == ["exactonce", "probe", "worker"]
            for role in ("worker", "beat"):
                until(
                    lambda role=role: (
                        run_in(
                            where, env, "-m", "celery", "-A", "proj", *check[:2], role
                        ).returncode
                        == 0
                    ),
                    timeout=60,
                    what=f"the image's health check of {role}\n{processes[role].log_tail()}",
                )
            probes = http_probes(where / "kubernetes.yaml")
            assert {(c, p) for c, p, _ in probes} == {
                ("beat", "/healthz"), ("beat", "/readyz"),
                ("worker", "/healthz"), ("worker", "/readyz"),
            }  # fmt: skip
            for container, path, port in probes:
                answer = status(ports[port], path)
                assert answer[0] == 200, (container, path, answer)

            store.kill()  # the store is gone: live, not ready
            until(
                lambda: status(ports[BEAT_PORT], "/readyz")[0] == 503,
                timeout=30,
                what="beat's /readyz once the store is down",
            )
            assert "could not reach the store" in status(ports[BEAT_PORT], "/readyz")[1]
            assert status(ports[BEAT_PORT], "/healthz")[0] == 200
            until(  # the store's last answer serves for STORE_MAX_AGE seconds
                lambda: status(ports[WORKER_PORT], "/readyz")[0] == 503,
                timeout=30,
                what="the worker's /readyz once the store is down",
            )
            ready = run_in(
                where, env, "-m", "celery", "-A", "proj", *check[:2], "worker", "--ready"
            )
            assert ready.returncode == 1, ready.stdout + ready.stderr
            assert "failing: the store did not answer" in ready.stdout
            assert status(ports[WORKER_PORT], "/healthz")[0] == 200
            for role, process in processes.items():
                assert process.alive(), f"{role} died\n{process.log_tail()}"
        finally:
            for process in processes.values():
                process.kill()
            empty_redis([broker])


def test_the_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    verify_units(copy_example("deploy", tmp_path), tmp_path)


def test_the_recipes_run_the_example_app_as_is() -> None:
    where = REPO_ROOT / "examples" / "deploy"
    commands: list[Any] = [unit(where / f"exactonce-{r}.service")[0] for r in ("beat", "worker")]
    commands.append(healthcheck(where / "Dockerfile"))
    for argv in commands:
        celery_args(argv)  # celery -A proj …, the module beside them
    assert (where / "proj.py").exists()
