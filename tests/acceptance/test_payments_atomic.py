"""examples/payments/atomic: every order charged exactly once while workers are SIGKILLed.

The example is copied to a temporary folder and its ``chaos.py`` run from
there as its README says, on a PostgreSQL database and a Redis broker
database of this test's own: it charges orders through a worker whose pool
processes (and, every fourth time, the whole worker) it SIGKILLs mid-body,
with a beat running the reconciler, then prints ``report.py``'s line. The
atomic task charges every order once (exit 0): 100 orders in the default
run. Under ``tox -e chaos``: the README's run of 1,000 charges, and the two
controls, which must fail the
check the way the README says: the gated task leaves orders uncharged, the
plain task (``acks_late``, ``reject_on_worker_lost``) charges some twice.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import services
from tests.acceptance.examples import copy_example, empty_redis, fresh_redis, run_in
from tests.acceptance.harness import process_env

#: The broker's Redis database: this test's alone, emptied before and after.
BROKER_DB = 10


@pytest.fixture
def database() -> Iterator[str]:
    """A fresh PostgreSQL database's URL, dropped afterwards."""
    services.need("postgres")
    import psycopg

    name = f"payments_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(services.POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield services.POSTGRES_URL.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with psycopg.connect(services.POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def chaos(
    tmp_path: Path, database: str, variant: str, *argv: str, pause: float = 0.1
) -> tuple[int, dict[str, Any]]:
    """``python chaos.py <argv>`` with ``PAYMENTS_VARIANT=variant``: its status and line."""
    broker = fresh_redis(BROKER_DB)
    where = copy_example("payments", tmp_path) / "atomic"
    env = process_env(
        PAYMENTS_DATABASE=database,
        PAYMENTS_BROKER_URL=broker[0],
        PAYMENTS_VARIANT=variant,
        PAYMENTS_PAUSE=str(pause),
    )
    try:
        done = run_in(where, env, "chaos.py", *argv, timeout=900)
    finally:
        empty_redis(broker)
    assert done.stdout, done.stderr[-3000:]
    return done.returncode, json.loads(done.stdout.splitlines()[-1])


@pytest.mark.timeout(300)
def test_atomic_charges_are_made_exactly_once_while_workers_are_killed(
    tmp_path: Path, database: str
) -> None:
    # (two pool processes, not the README's eight: the default run shares the machine)
    status, line = chaos(
        tmp_path, database, "atomic", "--charges", "100", "--concurrency", "2",
        "--kill-every", "1", "--kills", "8", pause=0.3,
    )  # fmt: skip
    report = line["report"]
    print(json.dumps(line))  # (the figures the evidence page shows)
    assert report["charged_once"] == 100, line
    assert (report["missing"], report["charged_twice"]) == (0, 0), line
    assert status == 0
    assert line["kills"] >= 6, line  # the chaos happened while charges ran


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", ["atomic", "gated", "plain"])
def test_the_readme_run_of_1000_charges_and_its_controls(
    tmp_path: Path, database: str, variant: str
) -> None:
    """The README's run: the atomic task passes; the controls fail it, each its own way."""
    status, line = chaos(tmp_path, database, variant, "--charges", "1000")
    report = line["report"]
    print(json.dumps(line))  # (the figures the note quotes)
    if variant == "atomic":
        assert (report["missing"], report["charged_twice"]) == (0, 0), line
        assert status == 0
    elif variant == "gated":  # at most once: a run killed before it committed is not run again
        assert report["missing"] > 0 and report["charged_twice"] == 0, line
        assert status == 1
    else:  # at least once: a run killed after it committed is run again
        assert report["charged_twice"] > 0, line
        assert status == 1
