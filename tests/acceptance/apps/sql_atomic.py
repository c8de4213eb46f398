"""The ledger app's worker with an atomic charge whose body writes through SQLAlchemy.

For a deployment on a SQL store (``postgresql://``, ``mysql://``,
``sqlite:///``): ``sql_charge(order, seconds)`` records its start, inserts
a row into the run's charges table (:data:`TABLE_VARIABLE` names it) through
``self.request.exactonce.connection``, sleeps ``seconds`` (the window a kill
falls in), and records its end. The row commits with the job's end, or not
at all.
"""

from __future__ import annotations

import os
import time
import uuid

import sqlalchemy as sa
from celery import Celery, Task

from tests.acceptance.apps.django_atomic import note
from tests.acceptance.apps.ledger_app import make_app

#: The atomic task :func:`register` adds.
CHARGE = "sql_charge"
#: The environment variable naming the charges table of a run.
TABLE_VARIABLE = "EXACTONCE_ACC_CHARGES_TABLE"


def charges(name: str) -> sa.Table:
    """The charges table ``name``: one row per charge that committed."""
    return sa.Table(
        name,
        sa.MetaData(),
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("order_id", sa.String(64), nullable=False),
    )


def register(app: Celery, ledger_path: str, table: str) -> None:
    """Add :data:`CHARGE` (``ExactOnceTask``, atomic) to ``app``, recording to ``ledger_path``."""
    from celery_exactonce import ExactOnceTask

    rows = charges(table)

    def charge(self: Task, order: str, seconds: float) -> None:
        note(ledger_path, self, "start", [order, seconds])
        insert = rows.insert().values(id=uuid.uuid4().hex, order_id=order)
        self.request.exactonce.connection.execute(insert)
        time.sleep(seconds)
        note(ledger_path, self, "end", [order, seconds])

    app.task(bind=True, shared=False, base=ExactOnceTask, name=CHARGE, exactonce_atomic=True)(
        charge
    )


app = make_app()
register(app, os.environ.get("EXACTONCE_ACC_LEDGER", ""), os.environ.get(TABLE_VARIABLE, ""))
