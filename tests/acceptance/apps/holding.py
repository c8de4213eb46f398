"""The body of unique_app's and once_app's holding task (no app here: each imports it)."""

from __future__ import annotations

import os
import time
from pathlib import Path

#: Seconds a body waits for its release at most.
HOLD_FOR = 120.0


def held(task_id: str, key: str) -> None:
    """Mark the start, then wait for ``release-<key>`` (a sync that takes a while)."""
    where = Path(os.environ["EXACTONCE_UNIQ_DIR"])
    (where / f"started-{task_id}").touch()
    deadline = time.monotonic() + HOLD_FOR
    while not (where / f"release-{key}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
