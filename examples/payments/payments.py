"""The payments app: a delayed charge, made once through its idempotency key.

What differs between machines comes from the environment:
``PAYMENTS_BROKER_URL`` (default ``redis://localhost:6379/0``),
``PAYMENTS_STORE_URL`` (default ``redis://localhost:6379/1``) and
``PAYMENTS_DB``, the provider's SQLite file (``provider.py``).
"""

from __future__ import annotations

import os
from typing import Any

import provider
from celery import Celery

from celery_exactonce import ExactOnceTask

app = Celery("payments")
app.conf.update(
    broker_url=os.environ.get("PAYMENTS_BROKER_URL", "redis://localhost:6379/0"),
    beat_scheduler="exactonce",  # a beat node dispatches the delayed jobs when due
    exactonce_store_url=os.environ.get("PAYMENTS_STORE_URL", "redis://localhost:6379/1"),
    exactonce_namespace="payments",
    task_serializer="json",
    accept_content=["json"],
    task_ignore_result=True,
)


@app.task(base=ExactOnceTask, bind=True, name="payments.charge")
def charge(self: Any, order_id: str, cents: int) -> bool:
    """Charge an order. The gate runs each attempt once; the key makes a second run harmless.

    The idempotency key is the same for every delivery and every run of this
    job (it derives from the job's id): the provider's unique index turns any
    second run into a no-op, and says so.
    """
    key = self.request.idempotency_key
    charged = provider.charge(order_id, cents, idempotency_key=key)
    print(f"{order_id}: {'charged' if charged else 'already charged, not again'} ({key})")
    return charged
