"""The examples run as documented (so they cannot rot)."""

from __future__ import annotations

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
