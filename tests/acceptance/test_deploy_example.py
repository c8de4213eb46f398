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
import dataclasses
import functools
import json
import os
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
from tests.acceptance.harness import REPO_ROOT, CeleryProcess, poll, process_env
from tests.integration.redis_server import redis_server
from tests.integration.servers import free_port

#: The broker's Redis database: this test's alone, emptied before and after.
BROKER_DB = 3
#: Where the recipes install the project, and the ports ``proj.py`` defaults to (the
#: manifest's probes ask them).
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


def image(path: Path) -> tuple[dict[str, str], str]:
    """A Dockerfile's ``ENV`` settings, and its ``CMD``'s shell command (``sh -c …``)."""
    env: dict[str, str] = {}
    command: list[str] = []
    for line in path.read_text(encoding="utf-8").replace("\\\n", " ").splitlines():
        if line.startswith("ENV "):
            name, _, value = line.removeprefix("ENV ").strip().partition("=")
            env[name] = value
        elif line.startswith("CMD "):
            command = json.loads(line.removeprefix("CMD "))
    assert command[:2] == ["sh", "-c"], command
    return env, command[2]


def pod_specs(path: Path) -> dict[str, tuple[str, dict[str, str]]]:
    """Each container of the manifest: its command (as one shell line) and its ``env``."""
    found = {}
    for document in yaml.safe_load_all(path.read_text(encoding="utf-8")):
        for container in document["spec"]["template"]["spec"]["containers"]:
            command = container["command"]
            line = command[2] if command[:2] == ["sh", "-c"] else shlex.join(command)
            env = {item["name"]: str(item["value"]) for item in container.get("env", ())}
            found[container["name"]] = (line, env)
    return found


class Shell(CeleryProcess):
    """A recipe's shell command (a container's ``CMD``), run from the example's folder."""

    def __init__(self, command: str, env: dict[str, str], where: Path, log_path: Path) -> None:
        self.command, self.env, self.cwd, self.log_path = command, env, where, log_path
        self.proc = None

    @property
    def argv(self) -> list[str]:
        return ["sh", "-c", self.command]


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


def live_not_ready(where: Path, beat: int, worker: int, worker_env: dict[str, str]) -> None:
    """Once the store is gone: beat and the worker answer live, and not ready, saying why."""
    until(
        lambda: status(beat, "/readyz")[0] == 503,
        timeout=30,
        what="beat's /readyz once the store is down",
    )
    assert "could not reach the store" in status(beat, "/readyz")[1]
    assert status(beat, "/healthz")[0] == 200
    until(  # the store's last answer serves for STORE_MAX_AGE seconds
        lambda: status(worker, "/readyz")[0] == 503,
        timeout=30,
        what="the worker's /readyz once the store is down",
    )
    ready = run_in(
        where, worker_env, "-m", "celery", "-A", "proj", "exactonce", "probe",
        "worker", "--ready",
    )  # fmt: skip
    assert ready.returncode == 1, ready.stdout + ready.stderr
    assert "failing: the store did not answer" in ready.stdout
    assert status(worker, "/healthz")[0] == 200


@dataclasses.dataclass
class Machine:
    """Where this test runs the recipes' processes: each role with a filesystem root of
    its own (a container's), this test's broker, store and ports in its environment."""

    tmp_path: Path
    broker: str
    store: str
    ports: dict[str, int]

    def env(self, role: str, *layers: dict[str, str], made: str = "") -> dict[str, str]:
        """This process's environment, the recipe's settings, then this test's broker, store
        and port; ``made``: the directory the recipe's supervisor makes (systemd's, a pod's
        volume), made here too."""
        merged = process_env()
        merged["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{merged.get('PATH', '')}"
        for layer in layers:
            merged.update(layer)
        port = "PROJ_METRICS_PORT" if role == "beat" else "PROJ_WORKER_METRICS_PORT"
        merged.update(PROJ_BROKER_URL=self.broker, PROJ_STORE_URL=self.store)
        merged[port] = str(self.ports[role])
        if "PROMETHEUS_MULTIPROC_DIR" in merged:
            path = merged["PROMETHEUS_MULTIPROC_DIR"]
            merged["PROMETHEUS_MULTIPROC_DIR"] = self.local(role, path, make=path == made)
        return merged

    def local(self, role: str, path: str, *, make: bool = False) -> str:
        """Where ``role``'s absolute ``path`` is in this test."""
        mapped = self.tmp_path / f"root-{role}" / path.lstrip("/")
        if make:
            mapped.mkdir(parents=True, exist_ok=True)
        return str(mapped)

    def shell(self, role: str, command: str, paths: tuple[str, ...]) -> str:
        """A container's command, its absolute ``paths`` in ``role``'s root."""
        return functools.reduce(
            lambda text, path: text.replace(path, self.local(role, path)), paths, command
        )


@pytest.mark.timeout(180)
def test_the_deploy_recipes_probe_a_live_beat_and_worker(tmp_path: Path) -> None:
    (broker,) = fresh_redis(BROKER_DB)
    where = copy_example("deploy", tmp_path)
    image_env, image_cmd = image(where / "Dockerfile")
    pods = pod_specs(where / "kubernetes.yaml")
    roles = ("beat", "worker", "image-worker", "pod-worker")
    processes: dict[str, CeleryProcess] = {}
    with redis_server() as store:
        machine = Machine(tmp_path, broker, store.url, {role: free_port() for role in roles})
        ports, env_of = machine.ports, machine.env
        try:
            for role in ("beat", "worker"):  # the systemd units; beat as the image runs it
                argv, unit_env = unit(where / f"exactonce-{role}.service")
                assert {"PROJ_BROKER_URL", "PROJ_STORE_URL"} <= set(unit_env)
                layers = [unit_env] if role == "worker" else [image_env, pods["beat"][1]]
                made = "/run/exactonce-worker"  # the worker unit's RuntimeDirectory
                processes[role] = ExampleProcess(
                    "proj", env_of(role, *layers, made=made), where, tmp_path / f"{role}.log",
                    *celery_args(argv),
                ).start()  # fmt: skip
            shells = {  # a worker container from the image's CMD, and from the pod's command
                "image-worker": (image_cmd, env_of("image-worker", image_env)),
                "pod-worker": (
                    pods["worker"][0],
                    env_of("pod-worker", image_env, pods["worker"][1], made="/metrics"),
                ),
            }
            paths = ("/tmp/exactonce-metrics", "/metrics")  # noqa: S108 (the recipes' paths)
            for role, (command, env) in shells.items():
                mapped = machine.shell(role, command, paths)
                processes[role] = Shell(mapped, env, where, tmp_path / f"{role}.log").start()
            check = celery_args(healthcheck(where / "Dockerfile"))
            assert check == ["exactonce", "probe", "worker"]
            asks = {"image-worker": "worker", "beat": "beat", "worker": "worker"}
            for role, kind in asks.items():
                env = env_of(role)
                until(
                    lambda env=env, kind=kind: (
                        run_in(where, env, "-m", "celery", "-A", "proj", *check[:2], kind)
                        .returncode == 0
                    ),
                    timeout=60,
                    what=f"the health check of {role}\n{processes[role].log_tail()}",
                )  # fmt: skip
            probes = http_probes(where / "kubernetes.yaml")
            assert {(c, p) for c, p, _ in probes} == {
                ("beat", "/healthz"), ("beat", "/readyz"),
                ("worker", "/healthz"), ("worker", "/readyz"),
            }  # fmt: skip
            for container, path, port in probes:
                assert port == (BEAT_PORT if container == "beat" else WORKER_PORT)
                role = "beat" if container == "beat" else "pod-worker"
                answer = status(ports[role], path)
                assert answer[0] == 200, (container, path, answer, processes[role].log_tail())

            store.kill()  # the store is gone: live, not ready
            live_not_ready(where, ports["beat"], ports["pod-worker"], env_of("pod-worker"))
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
