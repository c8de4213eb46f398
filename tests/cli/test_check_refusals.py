"""``celery exactonce check`` exits 1 naming the setting for each start-up refusal.

The cases are the ones a real worker or beat refuses to start with
(``tests/acceptance/test_startup_refusals.py``, on the same app and
environment): ``check`` must find each of them without starting anything,
print a ``FAIL`` line naming the setting, and say which setting in ``--json``.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from tests import services
from tests.acceptance.test_startup_refusals import APP_MODULE, CASES, Bad, environment
from tests.integration.redis_server import Cluster, RedisServer, cluster, redis_server

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def evicting_redis() -> Iterator[RedisServer]:
    with redis_server("--maxmemory-policy", "allkeys-lru") as server:
        yield server


def check(case: Bad, store_url: str | None, *extra: str) -> subprocess.CompletedProcess[str]:
    queue = f"cli-{uuid.uuid4().hex[:10]}"
    argv = [sys.executable, "-m", "celery", "-A", APP_MODULE, "exactonce", "check", *extra]
    env = environment(case, queue, store_url)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30, check=False)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_check_fails_naming_the_setting(case: Bad, request: pytest.FixtureRequest) -> None:
    services.need("redis")  # the store (the brokers are never connected to)
    store_url: str | None = services.REDIS_URL
    if case.store is None:
        store_url = None
    elif case.store == "evicting":
        store_url = request.getfixturevalue("evicting_redis").url

    done = check(case, store_url)
    assert done.returncode == 1, done.stdout + done.stderr
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAIL")]
    assert failed, done.stdout
    naming = [line for line in failed if case.names in line]
    assert naming, f"no FAIL line names {case.names!r}:\n{done.stdout}"
    for word in case.also:
        assert word in naming[0], f"{word!r} missing from {naming[0]!r}"
    assert "Traceback" not in done.stdout + done.stderr

    data = json.loads(check(case, store_url, "--json").stdout)
    assert data["ok"] is False
    assert any(
        c["status"] == "FAIL" and case.names in c["message"] + str(c["setting"])
        for c in data["checks"]
    ), data


@pytest.fixture(scope="module")
def replicated_cluster() -> Iterator[Cluster]:
    """Three masters, a replica each (killed by pid at the end of the module)."""
    with cluster(masters=3, replicas_per_master=1) as group:
        yield group


def test_check_on_a_cluster_names_each_masters_replicas(replicated_cluster: Cluster) -> None:
    services.need("redis")  # the broker's URL (never connected to)
    url = replicated_cluster.url()
    masters = sorted(s.port for s in replicated_cluster.master_servers())
    # Given min_replicas=1, a replica on each master: the replicas line lists them, ok
    waiting = Bad("cluster-replicas", "", conf={"exactonce_min_replicas": 1})
    done = check(waiting, url)
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = [line for line in done.stdout.splitlines() if " replicas " in f" {line} "]
    assert line.startswith("ok") and "each counted write waits for 1" in line
    named = [p for p in masters if f"master 127.0.0.1:{p} has 1" in line]
    assert len(named) == 1, line  # the one master of the namespace's slot
    # When min_replicas asks more replicas than the master has: FAIL, naming the
    # setting and the master (each check has a namespace of its own), and so in --json
    asking = Bad("cluster-too-few", "", conf={"exactonce_min_replicas": 2})
    done = check(asking, url)
    assert done.returncode == 1, done.stdout + done.stderr
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAIL")]
    assert len(failed) == 1 and "exactonce_min_replicas=2" in failed[0], done.stdout
    named = [p for p in masters if f"master 127.0.0.1:{p} has 1 connected replica(s)" in failed[0]]
    assert len(named) == 1, failed[0]
    data = json.loads(check(asking, url, "--json").stdout)
    (refused,) = [c for c in data["checks"] if c["status"] == "FAIL"]
    assert (refused["name"], refused["setting"]) == ("replicas", "exactonce_min_replicas")


def test_scenario_79_check_fails_on_a_metrics_port_already_taken() -> None:
    """``check`` binds each ``/metrics`` port set, on the default address, and releases it.

    Before the fix, ``check`` never tried the port: it said "all checks passed"
    for a port another process listened on (and for the default address,
    which prometheus-client could not bind at all).
    """
    services.need("redis")  # the store (the broker is never connected to)
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))  # noqa: S104  (as a node listening on the default address)
        taken.listen()
        port = taken.getsockname()[1]
        # Given exactonce_metrics_port on a port another process listens on: FAIL, naming it
        done = check(
            Bad("metrics-port-taken", "", conf={"exactonce_metrics_port": port}), services.REDIS_URL
        )
        assert done.returncode == 1, done.stdout + done.stderr
        (line,) = [line for line in done.stdout.splitlines() if line.startswith("FAIL")]
        assert f"exactonce_metrics_port={port}" in line and f"0.0.0.0:{port}" in line, line
        assert "set exactonce_metrics_port to a free port" in line, line
    # When the port is free again: ok, naming where beat will serve
    done = check(
        Bad("metrics-port-free", "", conf={"exactonce_metrics_port": port}), services.REDIS_URL
    )
    (line,) = [line for line in done.stdout.splitlines() if line.split()[1:2] == ["metrics"]]
    assert line.startswith("ok") and f"beat serves /metrics on 0.0.0.0:{port}" in line, line
