"""examples/payments runs as its README says: delayed charges, each order charged once.

The example is copied to a temporary folder and run from there: a worker and
a beat, ``python submit.py --orders 3 --countdown 2``, then ``report.py``
until the charges are made. Then a second attempt at an effect, both ways the
README shows: ``submit.py --again`` runs a charge's body again with the job's
key (the provider's unique index refuses it), and ``submit.py --redeliver``
publishes its message again (the worker's gate drops it). ``report.py`` must
still show one charge per order, and exit 0. Its broker and store are Redis
databases of this test's own, its provider file is in the test's folder.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.examples import (
    ExampleProcess,
    copy_example,
    empty_redis,
    fresh_redis,
    run_in,
)
from tests.acceptance.harness import poll, process_env

#: The broker's and the store's Redis databases: this test's alone, emptied before and after.
BROKER_DB, STORE_DB = 7, 8
ORDERS = 3


def run(env: dict[str, str], where: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """``python <argv>`` from the example's folder, to its end."""
    return run_in(where, env, *argv)


def report(env: dict[str, str], where: Path) -> tuple[int, dict[str, Any]]:
    """``python report.py``: its exit status and its summary."""
    done = run(env, where, "report.py")
    assert done.stdout, done.stderr
    return done.returncode, json.loads(done.stdout)


@pytest.mark.timeout(90)
def test_delayed_payments_charge_each_order_once_through_a_second_run_and_a_redelivery(
    tmp_path: Path,
) -> None:
    broker, store = fresh_redis(BROKER_DB, STORE_DB)
    where = copy_example("payments", tmp_path)
    env = process_env(
        PAYMENTS_BROKER_URL=broker,
        PAYMENTS_STORE_URL=store,
        PAYMENTS_DB=str(tmp_path / "provider.sqlite3"),
    )
    worker = ExampleProcess(
        "payments", env, where, tmp_path / "worker.log", "worker", "--loglevel", "INFO"
    )
    beat = ExampleProcess(
        "payments", env, where, tmp_path / "beat.log", "beat", "--loglevel", "INFO"
    )
    processes = [worker, beat]
    try:
        for process in processes:
            process.start()
        # Given delayed charges, submitted as the README says
        submitted = run(env, where, "submit.py", "--orders", str(ORDERS), "--countdown", "2")
        assert submitted.returncode == 0, submitted.stderr
        orders = json.loads(submitted.stdout)["submitted"]
        assert len({order["order"] for order in orders}) == ORDERS

        def charged() -> dict[str, Any] | None:
            for process in processes:
                assert process.alive(), process.log_tail()
            status, summary = report(env, where)
            assert status == 0, summary
            return summary if summary["charges"] >= ORDERS else None

        # When they fall due, a beat dispatches them and the worker charges each
        first = poll(charged, timeout=60, interval=0.5)
        assert first == {
            "orders": ORDERS,
            "charges": ORDERS,
            "calls": ORDERS,
            "refused": 0,
            "charged_twice": [],
        }
        job = orders[0]["task_id"]
        # And the body of one runs again, with the key the worker had
        again = run(env, where, "submit.py", "--again", job)
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout.splitlines()[-1]) == {
            "task_id": job,
            "order": orders[0]["order"],
            "charged": False,
        }
        # And its message is delivered again
        redelivered = run(env, where, "submit.py", "--redeliver", job)
        assert redelivered.returncode == 0, redelivered.stderr
        dropped = re.compile(
            rf"duplicate delivery of t:{re.escape(job)} \(attempt 0\) skipped"
            rf"[\s\S]*Task payments\.charge\[{re.escape(job)}\] ignored"
        )
        poll(lambda: dropped.search(worker.log()), timeout=30, interval=0.2)
        # Then each order was charged once: the second run reached the provider and was refused
        status, summary = report(env, where)
        assert status == 0, summary
        assert summary == {
            "orders": ORDERS,
            "charges": ORDERS,
            "calls": ORDERS + 1,
            "refused": 1,
            "charged_twice": [],
        }
        assert worker.log().count(f"{orders[0]['order']}: charged (") == 1
    finally:
        for process in processes:
            process.kill()
        empty_redis([broker, store])
