"""A rolling upgrade: the previous version's beat and worker beside this one's, on one store.

The previous version (:mod:`tests.acceptance.previous`: a commit of this
repository, run from its own source tree) and this one each run a beat and
a worker on one store and one Redis broker, and each submits gated jobs.
Every slot of the window runs once, whichever beat claimed it and whichever
worker ran it; every job submitted by either version runs once; both beats
dispatch and both workers run bodies. That is what "upgrade one node at a
time" needs: old and new never disagree about a slot or a job.
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from tests.acceptance import beats as b
from tests.acceptance.harness import Deployment, Ledger, in_tree, poll
from tests.acceptance.previous import previous_tree

ENTRIES = 10
#: Store-time seconds from "both beats started" to the stop.
RUN_SECONDS = 30
START_MARGIN, END_MARGIN = 2, 3
#: Gated jobs each version submits.
JOBS = 20

SUBMIT = """
import os, celery_exactonce
from tests.acceptance.apps.ledger_app import make_app
app = make_app(os.environ, set_as_current=False)
ids = [app.tasks["gated_record"].apply_async(args=("previous", i)).id for i in range({jobs})]
print(celery_exactonce.__file__)
print(" ".join(ids))
"""


def submit_previous(deployment: Deployment, jobs: int) -> list[str]:
    """``jobs`` gated jobs submitted by a process of the previous version; their ids."""
    tree = previous_tree()
    done = subprocess.run(
        [sys.executable, "-c", SUBMIT.format(jobs=jobs)],
        cwd=tree,
        env=in_tree(deployment.env, tree),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    module, ids = done.stdout.strip().splitlines()[-2:]
    assert module.startswith(str(tree)), module  # the previous version's package
    return ids.split()


@pytest.mark.timeout(240)
@pytest.mark.acceptance_matrix(
    brokers=("redis",), stores=("redis", "postgres"), slow_stores=("postgres",)
)
def test_previous_and_current_beats_and_workers_share_one_store(
    deployment: Deployment, ledger: Ledger, gate: None
) -> None:
    tree = previous_tree()
    old_worker = deployment.start_worker(concurrency=2, tree=tree)
    new_worker = deployment.start_worker(concurrency=2)
    beats = [
        deployment.start_beat(every=1, entries=ENTRIES, tree=tree, wait=False),
        deployment.start_beat(every=1, entries=ENTRIES, wait=False),
    ]
    for beat in beats:
        beat.wait_ready()
    for process in (old_worker, beats[0]):  # runs the previous version: its folder, first
        assert Path(f"/proc/{process.pid}/cwd").resolve() == tree.resolve()
        assert process.env["PYTHONPATH"].split(os.pathsep)[0] == str(tree)
    started = b.store_now(deployment)
    window_start = max(started, b.claim_floor(deployment)) + timedelta(seconds=START_MARGIN)

    submitted = [deployment.send("gated_record", "current", i).id for i in range(JOBS)]
    submitted += submit_previous(deployment, JOBS)
    b.run_until(deployment, started + timedelta(seconds=RUN_SECONDS), beats)
    for beat in beats:
        beat.kill()
    stopped = b.store_now(deployment)

    expected = b.slots(
        b.entry_names(ENTRIES), window_start, stopped - timedelta(seconds=END_MARGIN)
    )
    assert len(expected) >= ENTRIES * (RUN_SECONDS - 10)
    kills = {beat.node: stopped for beat in beats}
    orphans = b.unpublished_claims(deployment, expected - set(ledger.occurrences()), kills)
    b.wait_executed(ledger, expected - orphans)
    b.assert_each_ran_once(deployment, ledger, expected - orphans)
    b.assert_published_once(deployment, expected - orphans)
    poll(lambda: all(ledger.count(task_id=job) >= 1 for job in submitted), timeout=60)
    runs = ledger.executions("gated_record")
    assert {job for job, _ in runs} == set(submitted)
    assert all(count == 1 for count in runs.values()), runs
    for beat in beats:
        assert b.dispatched_by(beat) > 0, f"{beat!r} published nothing:\n{beat.log_tail()}"
    pids = {row.pid for row in ledger.rows(phase="run")}
    for worker in (old_worker, new_worker):
        assert any(worker.owns(pid) for pid in pids), f"{worker!r} ran nothing"
