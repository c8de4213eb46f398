"""A real ``celery worker`` and a real ``celery beat`` refuse every bad setting (SCENARIOS 68).

Each case starts the process (``apps/startup_app.py``) with one setting the
start-up checks refuse and asserts that it exits non-zero within
:data:`EXIT_WITHIN` seconds, with exactly one line of output naming the
setting, no traceback, and never a ``ready`` (worker) or ``Starting...``
(beat) line. The Redis eviction case runs on a private redis-server started
with ``--maxmemory-policy allkeys-lru`` (the machine's shared Redis is never
reconfigured).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from tests import services
from tests.acceptance.harness import BEAT_STARTED, REPO_ROOT, CeleryProcess, poll
from tests.integration.redis_server import RedisServer, redis_server

APP_MODULE = "tests.acceptance.apps.startup_app"

#: How long a refusing process may take to exit (it never connects to anything first).
EXIT_WITHIN = 10.0


@dataclasses.dataclass(frozen=True)
class Bad:
    """One refused setting: what the process is given, and what its one line must name."""

    id: str
    names: str
    roles: tuple[str, ...] = ("worker", "beat")
    broker: str = "redis"
    store: str | None = "redis"  # "evicting": the private server; None: no store URL at all
    conf: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    reject_on_lost: bool = False
    also: tuple[str, ...] = ()  # further words the same line must hold


CASES = (
    Bad("no-store-url", "exactonce_store_url", store=None),
    Bad(
        "amqp-without-confirm-publish",
        "confirm_publish",
        broker="amqp",
        also=("broker_transport_options",),
    ),
    Bad(
        "reject-on-worker-lost",
        "reject_on_worker_lost",
        reject_on_lost=True,
        also=("startup_app.gated",),
    ),
    Bad(
        "redis-eviction-policy",
        "maxmemory-policy",
        store="evicting",
        also=("exactonce_store_url", "allkeys-lru"),
    ),
    Bad("retention-below-look-back", "exactonce_retention", conf={"exactonce_retention": 10}),
    # Adoption past retention: a message redelivered after its adopted record was
    # purged would run again. Only the worker adopts.
    Bad(
        "retention-below-visibility-timeout",
        "exactonce_retention",
        roles=("worker",),
        conf={
            "exactonce_retention": 900,
            "broker_transport_options": {"visibility_timeout": 43_200},
        },
        also=("visibility_timeout", "43200"),
    ),
    Bad(
        "node-id-control-character", "exactonce_node_id", conf={"exactonce_node_id": "node\x07one"}
    ),
    Bad("node-id-too-long", "exactonce_node_id", conf={"exactonce_node_id": "n" * 256}),
)

PARAMS = [pytest.param(case, role, id=f"{role}-{case.id}") for case in CASES for role in case.roles]


class RefusingProcess(CeleryProcess):
    """``celery -A startup_app worker|beat`` in its own session, its output in a log file."""

    def __init__(self, role: str, env: Mapping[str, str], directory: Path, queue: str) -> None:
        self.role = role
        self.env = env
        self.directory = directory
        self.queue = queue
        self.log_path = directory / f"{role}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def argv(self) -> list[str]:
        celery = [sys.executable, "-m", "celery", "-A", APP_MODULE]
        if self.role == "worker":
            return [
                *celery,
                "worker",
                "-P",
                "prefork",
                "-c",
                "1",
                "--without-heartbeat",
                "--without-mingle",
                "--without-gossip",
                "-n",
                f"{self.queue}@%h",
                "-Q",
                self.queue,
                "--loglevel",
                "INFO",
            ]
        return [
            *celery,
            "beat",
            "-S",
            "exactonce",
            "-s",
            str(self.directory / "celerybeat-schedule"),
            "--loglevel",
            "INFO",
        ]


@pytest.fixture(scope="module")
def evicting_redis() -> Iterator[RedisServer]:
    with redis_server("--maxmemory-policy", "allkeys-lru") as server:
        yield server


def environment(case: Bad, queue: str, store_url: str | None) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("EXACTONCE_")}
    pythonpath = [str(REPO_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    conf = dict(case.conf)
    if case.broker == "redis":
        options = {**conf.get("broker_transport_options", {}), "global_keyprefix": f"{queue}:"}
        conf["broker_transport_options"] = options
        broker_url = services.REDIS_URL.rsplit("/", 1)[0] + "/10"
    else:
        broker_url = services.AMQP_URL  # no confirm_publish: that is the bad setting
    env.update(
        PYTHONPATH=os.pathsep.join(pythonpath),
        PYTHONUNBUFFERED="1",
        EXACTONCE_SU_BROKER_URL=broker_url,
        EXACTONCE_SU_QUEUE=queue,
        EXACTONCE_SU_NAMESPACE=queue,
        EXACTONCE_SU_CONF=json.dumps(conf),
    )
    if store_url is not None:
        env["EXACTONCE_SU_STORE_URL"] = store_url
    if case.reject_on_lost:
        env["EXACTONCE_SU_REJECT_ON_LOST"] = "1"
    return env


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("case", "role"), PARAMS)
def test_a_refused_setting_stops_the_process_with_one_line_naming_it(
    case: Bad, role: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """SCENARIOS 68: exit non-zero within 10 s, one line naming the setting, never ready.

    Fails on the code before the fix: the worker's checks ran in a ``worker_init``
    receiver, whose exception Celery logs and swallows (the worker reported
    ready); beat died of a traceback, or started (no ``confirm_publish``, no
    ``reject_on_worker_lost`` check); retention was not compared with the
    visibility timeout and ``exactonce_node_id`` was not validated.
    """
    services.need("redis")
    if case.broker == "amqp":
        services.need("rabbitmq")
    store_url: str | None = services.REDIS_URL
    if case.store is None:
        store_url = None
    elif case.store == "evicting":
        store_url = request.getfixturevalue("evicting_redis").url
    queue = f"su-{uuid.uuid4().hex[:10]}"
    process = RefusingProcess(role, environment(case, queue, store_url), tmp_path, queue)

    # When the process starts with the bad setting
    process.start()
    try:
        try:
            poll(lambda: not process.alive(), timeout=EXIT_WITHIN, interval=0.05)
        except AssertionError:
            raise AssertionError(
                f"{role} still running {EXIT_WITHIN} s after start; log:\n{process.log_tail()}"
            ) from None
    finally:
        process.kill()  # the whole group, even if it exited (no pool child may outlive it)

    # Then it exited non-zero, with one line naming the setting and no traceback
    log = process.log()
    assert process.proc is not None and process.proc.returncode not in (0, None), log
    lines = [line for line in log.splitlines() if case.names in line]
    assert len(lines) == 1, f"want one line naming {case.names!r}; log:\n{log}"
    for word in case.also:
        assert word in lines[0], f"{word!r} missing from {lines[0]!r}"
    assert "Traceback" not in log, log
    # ... and it never reported ready (the worker) nor started ticking (beat)
    if role == "worker":
        assert not any(line.rstrip().endswith(" ready.") for line in log.splitlines()), log
    else:
        assert BEAT_STARTED not in log, log
