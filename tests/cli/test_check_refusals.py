"""``celery exactonce check`` exits 1 naming the setting for each start-up refusal.

The cases are the ones a real worker or beat refuses to start with
(``tests/acceptance/test_startup_refusals.py``, on the same app and
environment): ``check`` must find each of them without starting anything,
print a ``FAIL`` line naming the setting, and say which setting in ``--json``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from tests import services
from tests.acceptance.test_startup_refusals import APP_MODULE, CASES, Bad, environment
from tests.integration.redis_server import RedisServer, redis_server

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
