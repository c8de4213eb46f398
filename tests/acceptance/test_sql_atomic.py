"""Atomic charges on a SQL store, their body writing through SQLAlchemy, in a real worker.

A ``celery worker`` on a ``postgresql://`` store (``mysql://`` and
``sqlite:///`` under ``tox -e chaos``) runs ``sql_charge``
(:mod:`tests.acceptance.apps.sql_atomic`), an ``exactonce_atomic`` task
whose body inserts its row through ``self.request.exactonce.connection``;
a beat runs the reconciler. Pool children are SIGKILLed in the middle of
bodies: each charge's row is there exactly once, its job ``SUCCEEDED``.
"""

from __future__ import annotations

import json

import pytest

from celery_exactonce.core.states import State
from tests.acceptance.apps import sql_atomic
from tests.acceptance.harness import Deployment, Ledger, poll
from tests.acceptance.test_django_atomic import CHARGES, KILLS
from tests.acceptance.test_reconcile import FAST, RECONCILER_ONLY


@pytest.mark.timeout(240)
@pytest.mark.acceptance_matrix(
    brokers=("redis",), stores=("postgres", "mysql", "sqlite"), slow_stores=("mysql", "sqlite")
)
def test_scenario_77_atomic_sqlalchemy_charges_commit_once_though_workers_die_mid_body(
    deployment: Deployment, ledger: Ledger, gate: None
) -> None:
    """The killed runs rolled back (their rows went, their jobs stayed ``DISPATCHED``); the
    reconciler redispatched them, and each next run committed its row and its end together."""
    import sqlalchemy as sa

    table = f"acc_charges_{deployment.uid}"
    deployment.extra_env.update(
        {sql_atomic.TABLE_VARIABLE: table, "EXACTONCE_ACC_EXTRA_CONF": json.dumps(FAST)}
    )
    engine = deployment.store().engine
    rows = sql_atomic.charges(table)
    rows.create(engine)
    try:
        worker = deployment.start_worker(concurrency=1, app_module=sql_atomic.__name__)
        deployment.start_beat(every=0, extra_env=RECONCILER_ONLY)
        app = deployment.app()
        sql_atomic.register(app, str(deployment.ledger_path), table)
        for n in range(CHARGES):
            app.tasks[sql_atomic.CHARGE].apply_async((f"o{n}", 0.5), task_id=f"charge-{n}")
        worker.kill_children_in_bodies(ledger, KILLS)

        def settled() -> bool:
            return all(deployment.job(f"charge-{n}").state.terminal for n in range(CHARGES))

        poll(settled, timeout=150)
        with engine.connect() as conn:
            query = sa.select(rows.c.order_id, sa.func.count()).group_by(rows.c.order_id)
            charged = dict(conn.execute(query).all())
        for n in range(CHARGES):
            job = deployment.record(f"charge-{n}")
            assert job.state is State.SUCCEEDED, (n, job.reason)
            assert charged.get(f"o{n}") == 1, (n, charged.get(f"o{n}"))
        assert len(charged) == CHARGES
        assert ledger.count(task=sql_atomic.CHARGE, phase="start") >= CHARGES + KILLS
    finally:
        rows.drop(engine)
