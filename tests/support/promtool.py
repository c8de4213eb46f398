"""Prometheus's ``promtool``, for the tests of the shipped alert rules (examples/prometheus).

``.ci/run`` unpacks it from Debian's ``prometheus`` package. Without it a test
that needs it is skipped, with the reason (failed under
``EXACTONCE_REQUIRE_SERVICES``, as a missing service is).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests import services

RULES_DIR = Path(__file__).resolve().parents[2] / "examples" / "prometheus"
RULES = RULES_DIR / "alerts.yml"


def promtool() -> str:
    """The ``promtool`` on ``PATH``; skips (or fails, in CI) without one."""
    found = shutil.which("promtool")
    if found is None:
        message = (
            "promtool is not installed (Debian's prometheus package has it; "
            ".ci/run unpacks it to /usr/local/bin)"
        )
        if services.required():
            pytest.fail(f"{message} and EXACTONCE_REQUIRE_SERVICES is set", pytrace=False)
        pytest.skip(message)
    return found


def run(*args: str | Path, cwd: Path = RULES_DIR) -> subprocess.CompletedProcess[str]:
    """``promtool ARGS`` in ``cwd``, bounded in time; its output kept for the assertion."""
    return subprocess.run(
        [promtool(), *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def series(name: str, labels: dict[str, Any], values: str) -> dict[str, str]:
    """One ``input_series`` item of a rule test (``values`` in promtool's notation)."""
    text = ", ".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    return {"series": f"{name}{{{text}}}", "values": values}
