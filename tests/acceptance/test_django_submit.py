"""The transactional submit with real processes: django:// store, a worker, a beat.

A submitter process writes a row of its own and submits an ``ExactOnceTask``
in one ``transaction.atomic()``: committed, the job runs once; rolled back,
there is no job and no message; SIGKILLed after the commit and before the
publish, the job waits ``SCHEDULED`` and runs once after a reconcile pass.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from celery_exactonce.contrib.django.store import DjangoStore
from celery_exactonce.core.states import State
from tests.acceptance.django_project import DjangoBeat, DjangoDatabase
from tests.acceptance.harness import REPO_ROOT, Deployment, Ledger, holds, poll
from tests.acceptance.test_reconcile import FAST

#: How long "nothing happens" is watched for after a rolled-back submit.
QUIET = 3.0


def submit(deployment: Deployment, database: DjangoDatabase, mode: str, task_id: str) -> int:
    """Run the submitter (``apps/django_submit.py``); its exit status."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.acceptance.apps.django_submit", mode, task_id],
        env=deployment.env,
        cwd=REPO_ROOT,
        timeout=60,
        check=False,
        capture_output=True,
    )
    assert done.returncode in (0, -9), done.stderr.decode(errors="replace")[-2000:]
    return done.returncode


@pytest.fixture
def project(deployment: Deployment, django_database: DjangoDatabase) -> Iterator[Deployment]:
    """The deployment on the Django database's store, scaled down; a worker on it.

    Closed here, while the database is still there (the store's namespace is dropped).
    """
    deployment.store_url = "django://default"  # as the processes see it
    # On PostgreSQL every process connects as a role with no CREATE: the worker and
    # the beat below start only if they run no DDL.
    deployment.extra_env.update(
        django_database.env(ddl=False), EXACTONCE_ACC_EXTRA_CONF=json.dumps(FAST)
    )
    deployment._store = DjangoStore(
        DjangoDatabase.ALIAS, namespace=deployment.namespace, retention=3600
    )
    deployment.start_worker(concurrency=2)
    yield deployment
    deployment.close()


@pytest.mark.timeout(180)
@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis",))
def test_a_committed_transaction_runs_its_job_once_and_a_rolled_back_one_nothing(
    project: Deployment, ledger: Ledger, gate: None, django_database: DjangoDatabase
) -> None:
    from django.contrib.auth.models import User

    # When one submit commits and another rolls back
    assert submit(project, django_database, "commit", "tx-committed") == 0
    assert submit(project, django_database, "rollback", "tx-rolled-back") == 0
    # Then the committed one ran once, with its row
    poll(lambda: ledger.count(task_id="tx-committed") >= 1, timeout=30)
    assert User.objects.filter(username="tx-committed").exists()
    # ... and the rolled-back one left no row, no job and no message
    assert not User.objects.filter(username="tx-rolled-back").exists()
    assert project.job("tx-rolled-back") is None
    holds(lambda: ledger.count(task_id="tx-rolled-back") == 0, QUIET)
    assert project.purge() == 0
    assert ledger.count(task_id="tx-committed") == 1


@pytest.mark.timeout(180)
@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis",))
def test_a_sigkill_between_commit_and_publish_runs_the_job_once_after_a_reconcile_pass(
    project: Deployment, ledger: Ledger, gate: None, django_database: DjangoDatabase
) -> None:
    from django.contrib.auth.models import User

    # Given a submitter SIGKILLed after its commit, before its publish
    assert submit(project, django_database, "kill", "tx-killed") == -9
    assert User.objects.filter(username="tx-killed").exists()
    assert project.record("tx-killed").state is State.SCHEDULED
    holds(lambda: ledger.count(task_id="tx-killed") == 0, QUIET)  # nothing was published
    # When a beat (whose reconciler replays stale SCHEDULED jobs) runs
    env = {**project.env, "EXACTONCE_ACC_BEAT_EVERY": "0"}
    beat = DjangoBeat(env, project.tmp_path, "beat-1", "exactonce")
    project.beats.append(beat)
    beat.start().wait_ready()
    # Then the job runs once
    poll(lambda: ledger.count(task_id="tx-killed") >= 1, timeout=60)
    holds(lambda: ledger.count(task_id="tx-killed") == 1, QUIET)
    assert project.record("tx-killed").state is State.SUCCEEDED
