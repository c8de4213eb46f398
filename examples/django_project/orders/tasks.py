"""The report, run by beat on every node's schedule, once per occurrence."""

from __future__ import annotations

from typing import Any

from celery import shared_task

from celery_exactonce import ExactOnceTask


@shared_task(bind=True, base=ExactOnceTask, name="orders.report")
def report(self: Any) -> int:
    """Count the orders; write down which occurrence this run is."""
    from orders.models import Order, ReportRun

    headers = self.request.headers or {}
    ReportRun.objects.create(
        key=headers.get("exactonce_key") or getattr(self.request, "exactonce_key", ""),
        fire_time=headers.get("exactonce_fire_time")
        or getattr(self.request, "exactonce_fire_time", ""),
        idempotency_key=self.request.idempotency_key,
    )
    return Order.objects.count()


@shared_task(bind=True, base=ExactOnceTask, name="orders.welcome")
def welcome(self: Any, order_id: int) -> None:
    """Submitted in the transaction that creates an order: it runs only if that commits."""
