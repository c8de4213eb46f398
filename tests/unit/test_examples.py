"""The examples run as documented (so they cannot rot)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def test_store_tour_runs_with_no_servers() -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "store_tour.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        # As from a checkout: the package need not be installed to run the examples.
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr
    assert "beat-1 claim: created; beat-2 claim: exists" in result.stdout
    assert "first delivery: applied; redelivery: conflict" in result.stdout


def payments(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """``python <argv>`` in examples/payments, the provider's file in ``tmp_path``."""
    return subprocess.run(
        [sys.executable, *argv],
        cwd=EXAMPLES / "payments",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "PAYMENTS_DB": str(tmp_path / "provider.sqlite3"),
            "PYTHONDONTWRITEBYTECODE": "1",
        },
    )


CHARGE = "import provider; print(provider.charge({order!r}, 1000, idempotency_key={key!r}))"


def test_the_payments_provider_charges_a_key_once(tmp_path: Path) -> None:
    # Given a charge, then the same charge again under the same key
    for expected in ("True", "False"):
        done = payments(tmp_path, "-c", CHARGE.format(order="order-1", key="k-1"))
        assert (done.returncode, done.stdout.strip()) == (0, expected), done.stderr
    # Then the report counts one charge and one refused call, and passes
    checked = payments(tmp_path, "report.py")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert json.loads(checked.stdout) == {
        "orders": 1,
        "charges": 1,
        "calls": 2,
        "refused": 1,
        "charged_twice": [],
    }


def test_the_payments_report_fails_on_an_order_charged_twice(tmp_path: Path) -> None:
    # Given one order charged under two keys (a body keyed on something new per run)
    for key in ("fresh-1", "fresh-2"):
        done = payments(tmp_path, "-c", CHARGE.format(order="order-1", key=key))
        assert (done.returncode, done.stdout.strip()) == (0, "True"), done.stderr
    done = payments(tmp_path, "-c", CHARGE.format(order="order-2", key="k-2"))
    assert done.returncode == 0, done.stderr
    # Then the report names it and exits 1
    checked = payments(tmp_path, "report.py")
    assert checked.returncode == 1, checked.stdout + checked.stderr
    summary = json.loads(checked.stdout)
    assert summary["charged_twice"] == ["order-1"]
    assert (summary["orders"], summary["charges"], summary["refused"]) == (2, 3, 0)
