"""The billing app and its tasks, written as for production.

Its settings point at Redis: the tests never reach it. The plugin's
``exactonce_app`` runs the app on an in-memory broker, result backend and
store for each test.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from billing import provider
from celery_exactonce import ExactOnceTask

app = Celery("billing")
app.conf.update(
    broker_url="redis://localhost:6379/0",
    exactonce_store_url="redis://localhost:6379/1",
    exactonce_namespace="billing",
    beat_scheduler="exactonce",
)

#: Receipts sent, by order (a module-level list stands in for an email service).
RECEIPTS: list[str] = []
#: How many times ``flaky_sync`` still fails, by order.
FAILURES: dict[str, int] = {}


@app.task(base=ExactOnceTask, bind=True, name="billing.charge")
def charge(self: Any, order_id: str, cents: int) -> tuple[str, int]:
    """Charge an order once: the provider dedupes on the job's idempotency key."""
    return provider.charge(order_id, cents, idempotency_key=self.request.idempotency_key)


@app.task(base=ExactOnceTask, bind=True, name="billing.send_receipt")
def send_receipt(self: Any, order_id: str) -> None:
    """Sent an hour after the charge (``countdown=3600``): a delayed job."""
    RECEIPTS.append(order_id)


@app.task(
    base=ExactOnceTask,
    bind=True,
    name="billing.flaky_sync",
    autoretry_for=(provider.Declined,),
    max_retries=3,
    default_retry_delay=0,
)
def flaky_sync(self: Any, order_id: str) -> int:
    """Fails ``FAILURES[order_id]`` times, then succeeds: one run per attempt."""
    if FAILURES.get(order_id, 0) > 0:
        FAILURES[order_id] -= 1
        raise provider.Declined(order_id)
    return int(self.request.retries)
