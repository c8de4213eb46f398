"""Retry, requeue and replace inside the body's own ``transaction.atomic()``, in a real worker.

A ``celery worker`` on the ``django://`` store runs gated tasks
(:mod:`tests.acceptance.apps.django_atomic`) that, on their first attempt,
write a row inside ``transaction.atomic()`` and leave the block by
``self.retry()``, ``Reject(requeue=True)`` or ``self.replace()``. The block
rolls back; the job still moves on, on SQLite and on PostgreSQL: the next
attempt runs once, or the replacement exists and runs once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from celery_exactonce.contrib.django.store import DjangoStore
from celery_exactonce.core.states import State
from celery_exactonce.dispatch.messages import replacement_job_id
from tests.acceptance.apps import django_atomic
from tests.acceptance.apps.ledger_app import make_app
from tests.acceptance.django_project import DJANGO_APP, DjangoBeat, DjangoDatabase
from tests.acceptance.harness import Deployment, Ledger, WorkerProcess, holds, poll
from tests.acceptance.test_reconcile import FAST, RECONCILER_ONLY


@pytest.fixture
def project(deployment: Deployment, django_database: DjangoDatabase) -> Iterator[Deployment]:
    """The deployment on the Django database's store; one worker of the Django app on it."""
    deployment.store_url = "django://default"  # as the worker sees it
    deployment.extra_env.update(
        django_database.env(ddl=False), EXACTONCE_ACC_EXTRA_CONF=json.dumps(FAST)
    )
    deployment._store = DjangoStore(
        DjangoDatabase.ALIAS, namespace=deployment.namespace, retention=3600
    )
    deployment.app()  # the queue exists before the worker consumes
    worker = WorkerProcess(
        deployment.env,
        deployment.tmp_path / "worker-1.log",
        queue=deployment.queue,
        concurrency=1,
        app_module=DJANGO_APP,
    )
    deployment.workers.append(worker)
    worker.start().wait_ready()
    yield deployment
    deployment.close()


@pytest.mark.timeout(120)
@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis",))
def test_scenario_76_retry_requeue_and_replace_inside_the_bodys_atomic_move_the_job_on(
    project: Deployment, ledger: Ledger, gate: None
) -> None:
    """Each job's next attempt (or its replacement) runs once; the block's rows never stay.

    Before the fix, the retry's next attempt was written inside the body's
    block and rolled back with it: the job stayed ``RUNNING`` at attempt 0
    and the worker refused the attempt-1 message as stale. The replacement's
    record and publish were rolled back too: nothing ran, and the job ended
    ``SUCCEEDED`` "replaced by" a job that did not exist.
    """
    from django.contrib.auth.models import User

    # The test's own app submits through the same database (its alias here).
    app = make_app(
        {**project.env, "EXACTONCE_ACC_STORE_URL": "django://acceptance"}, set_as_current=False
    )
    django_atomic.register(app, str(project.ledger_path))
    for name in django_atomic.TASKS:
        app.tasks[name].apply_async(("x",), task_id=f"a-{name}")
    replacement = replacement_job_id("a-atomic_replace", 1)

    def settled() -> bool:
        jobs = [project.job(f"a-{name}") for name in django_atomic.TASKS]
        jobs.append(project.job(replacement))
        return all(job is not None and job.state.terminal for job in jobs)

    poll(settled, timeout=40)
    for name in ("atomic_retry", "atomic_requeue"):
        job = project.record(f"a-{name}")
        assert (job.state, job.attempt) == (State.SUCCEEDED, 1), job.reason
        assert ledger.executions(name) == {(f"a-{name}", 0): 1, (f"a-{name}", 1): 1}
    replaced = project.record("a-atomic_replace")
    assert replaced.state is State.SUCCEEDED and replacement in replaced.reason
    assert project.record(replacement).state is State.SUCCEEDED
    holds(lambda: ledger.count(task="gated_record", task_id="a-atomic_replace") == 1, 1.0)
    assert not User.objects.filter(username__startswith="a-").exists()  # every block rolled back


#: Atomic charges submitted, and pool children SIGKILLed in the middle of one.
CHARGES, KILLS = 30, 4


@pytest.mark.timeout(240)
@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis",))
@pytest.mark.parametrize(
    "django_database",
    [
        "postgres",
        pytest.param("sqlite", marks=pytest.mark.slow),
        pytest.param("mysql", marks=pytest.mark.slow),
    ],
    indirect=True,
)
def test_scenario_77_atomic_charges_commit_once_though_workers_die_mid_body(
    project: Deployment, ledger: Ledger, gate: None
) -> None:
    """Each charge's row is there exactly once, its job ``SUCCEEDED``, after kills mid-body.

    A pool child is SIGKILLed while a body runs: its transaction rolls back
    (the row it created goes, the job is still ``DISPATCHED``), Celery acks
    the lost message, and the reconciler (on a beat) redispatches the job,
    the default for an atomic task; the next run commits the row and the end
    together. The ledger (another file, outside the transaction) shows the
    killed runs' starts.
    """
    from django.contrib.auth.models import User

    beat = DjangoBeat(
        {**project.env, **RECONCILER_ONLY, "EXACTONCE_ACC_BEAT_EVERY": "0"},
        project.tmp_path,
        "beat-reconciler",
        scheduler="exactonce",
    )
    project.beats.append(beat)
    beat.start().wait_ready()
    app = make_app(
        {**project.env, "EXACTONCE_ACC_STORE_URL": "django://acceptance"}, set_as_current=False
    )
    django_atomic.register(app, str(project.ledger_path))
    for n in range(CHARGES):
        app.tasks[django_atomic.CHARGE].apply_async((f"o{n}", 0.5), task_id=f"charge-{n}")
    project.workers[0].kill_children_in_bodies(ledger, KILLS)

    def settled() -> bool:
        return all(project.job(f"charge-{n}").state.terminal for n in range(CHARGES))

    poll(settled, timeout=150)
    for n in range(CHARGES):
        job = project.record(f"charge-{n}")
        assert job.state is State.SUCCEEDED, (n, job.reason)
        assert User.objects.filter(username__startswith=f"charge-o{n}-").count() == 1, n
    starts = ledger.count(task=django_atomic.CHARGE, phase="start")
    assert starts >= CHARGES + KILLS  # the killed runs started, and ran again
    assert ledger.count(task=django_atomic.CHARGE, phase="end") >= CHARGES
