"""A slim beat (entries only, no task module) beside workers that gate the tasks.

SCENARIOS 67: every occurrence and every delayed job runs once, or beat
refuses to start naming the entry; never a job treated as plain, never
``FAILED 'unknown task'`` for a record that says it is gated. The workers and
the sending app import the tasks; the beat process registers none of them
(``EXACTONCE_ACC_SLIM``).
"""

from __future__ import annotations

import pytest

from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from tests.acceptance.apps.ledger_app import SLIM
from tests.acceptance.harness import Deployment, Ledger, Row, poll

pytestmark = [
    pytest.mark.usefixtures("gate"),
    pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis", "postgres")),
]

#: How long a refused beat may take to exit (imports, store connection, then the check).
EXIT_TIMEOUT = 10.0


@pytest.mark.timeout(120)
def test_a_slim_beat_runs_every_occurrence_and_every_delayed_job_once(
    deployment: Deployment, ledger: Ledger
) -> None:
    """SCENARIOS 67. Fails before the fix: the delayed jobs and the countdown retry that
    the slim beat swept ended ``FAILED 'unknown task'``, and the gated entry's
    occurrences were written ``PUBLISHED`` as plain and refused by the gate."""
    # Given a worker that gates the tasks, and a beat that imports none of them but
    # whose entries declare which are gated
    deployment.start_worker(concurrency=2)
    beat = deployment.start_beat(every=1, extra_env={SLIM: "declared"})
    # When delayed jobs and a task that retries with a countdown are submitted
    delayed = [deployment.send("gated_record", f"delayed-{i}", countdown=1.5) for i in range(5)]
    retrying = deployment.send("gated_retry", 1, 1.0)
    # Then each delayed job runs once, the retry's two attempts run once each
    for result in delayed:
        ledger.wait_count(1, task_id=result.id)
    rows = ledger.wait_count(2, task_id=retrying.id)
    assert sorted(row.attempt for row in rows) == [0, 1]

    # and the gated entry's occurrences run, once per fire time, as do the plain one's
    def gated_occurrences() -> list[Row] | None:
        rows = [row for row in ledger.rows(task="gated_record") if row.args == ["beat"]]
        return rows if len(rows) >= 3 else None

    occurrences = poll(gated_occurrences, timeout=30)
    assert len({row.task_id for row in occurrences}) == len(occurrences)
    ledger.wait_count(3, task="plain_record")
    # and no record the beat touched was failed or left as plain
    store = deployment.store()
    for result in [*delayed, retrying]:
        job = store.get(JobRef.submitted(result.id))
        assert job is not None and job.state is State.SUCCEEDED, job
    for row in occurrences:
        job = store.get(JobRef.occurrence(row.task_id))
        assert job is not None and job.state is State.SUCCEEDED, job
    assert not beat.events("dispatch_failed")
    assert beat.alive(), beat.log_tail()


@pytest.mark.timeout(60)
def test_a_slim_beat_whose_entries_do_not_declare_refuses_to_start_naming_one(
    deployment: Deployment,
) -> None:
    """SCENARIOS 67. Fails before the fix: the beat started and treated every entry whose
    task it could not see as plain; a gated task's occurrences never ran."""
    beat = deployment.start_beat(every=1, extra_env={SLIM: "1"}, wait=False)
    poll(lambda: not beat.alive(), timeout=EXIT_TIMEOUT, interval=0.1)
    assert beat.proc is not None and beat.proc.returncode != 0, beat.log_tail()
    log = beat.log()
    (line,) = [
        line for line in log.splitlines() if "celery-exactonce: beat refused to start" in line
    ]
    assert "beat entry 'gated-every'" in line or "beat entry 'plain-every'" in line
    assert "Import the task's module" in line and "'gated': True" in line
    assert not beat.events("dispatched")
