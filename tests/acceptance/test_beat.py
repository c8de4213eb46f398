"""Several real ``celery beat -S exactonce`` processes and a worker: each slot runs once.

A first acceptance step of the scheduler (the full matrix, 3 beats x 20 entries
x 60 s with restarts on every store, comes with the rest of the scheduler).
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from celery_exactonce.jobs import JobRef
from tests.acceptance.harness import APP_MODULE, Deployment, Ledger, poll


class BeatProcess:
    def __init__(self, deployment: Deployment, index: int) -> None:
        self.log_path = Path(deployment.tmp_path) / f"beat-{index}.log"
        env = {**deployment.env, "EXACTONCE_ACC_BEAT_EVERY": "1"}
        argv = [
            sys.executable, "-m", "celery", "-A", APP_MODULE, "beat", "-S", "exactonce",
            "-s", str(Path(deployment.tmp_path) / f"beat-{index}.unused"), "--loglevel", "INFO",
        ]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis", "postgres"))
def test_three_beats_one_run_per_slot_through_a_sigkill(
    deployment: Deployment, ledger: Ledger, gate: None
) -> None:
    deployment.start_worker(concurrency=2)
    beats = [BeatProcess(deployment, i) for i in range(3)]
    try:
        # Given three beat nodes ticking the same every-second entries
        ledger.wait_count(4, task="gated_record", timeout=60)
        # When one of them is SIGKILLed and restarted
        beats[0].kill()
        beats[0] = BeatProcess(deployment, 3)
        ledger.wait_count(12, task="gated_record", timeout=60)
    finally:
        for beat in beats:
            beat.kill()
    # Then no occurrence ran twice, and they are consecutive seconds
    rows = ledger.rows(task="gated_record")
    per_task = Counter(row.task_id for row in rows)
    assert max(per_task.values()) == 1, per_task.most_common(3)
    store = deployment.store()
    fires = sorted(
        job.fire_time
        for task_id in per_task
        if (job := store.get(JobRef.occurrence(task_id))) is not None and job.fire_time
    )
    assert len(fires) == len(per_task)
    gaps = sum(1 for a, b in itertools.pairwise(fires) if (b - a).total_seconds() != 1)
    assert gaps <= 1  # at most the slot the killed node had claimed and not yet dispatched
    plain = Counter(row.task_id for row in ledger.rows(task="plain_record"))
    assert plain and max(plain.values()) == 1  # plain tasks: one publish per slot
    poll(lambda: all(beat.process.poll() is not None for beat in beats))
