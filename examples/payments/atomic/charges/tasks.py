"""``charges.charge(order_id)``: charge an order once. ``PAYMENTS_VARIANT`` says how it runs.

The body is the same in every variant, as a careful Django developer writes
it: in ``transaction.atomic()``, lock the order, write its charge, mark the
order charged; then send the receipt (a pause stands in for it). Pauses of
random length fall between the steps, so a worker killed mid-body is killed
at any point of it.

* ``atomic`` (the default): an ``ExactOnceTask`` with ``exactonce_atomic``.
  The gate, the body (its ``atomic()`` block is a savepoint inside) and the
  job's ``SUCCEEDED`` are one transaction: a run killed anywhere leaves
  nothing, and the reconciler dispatches the job again. Every order is
  charged exactly once.
* ``gated``: an ``ExactOnceTask``. At most once: a run killed before its
  block committed leaves the job ``RUNNING`` and the order not charged, and
  it is not run again. Orders go missing.
* ``plain``: a plain Celery task with ``acks_late`` and
  ``reject_on_worker_lost``, Celery's way to at least once: a run killed
  after its block committed is delivered and run again. Orders are charged
  twice.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

from celery import shared_task
from django.conf import settings
from django.db import transaction

from celery_exactonce import ExactOnceTask

OPTIONS: dict[str, dict[str, Any]] = {
    "atomic": {"base": ExactOnceTask, "exactonce_atomic": True},
    "gated": {"base": ExactOnceTask},
    "plain": {"acks_late": True, "reject_on_worker_lost": True},
}


#: The longest pause between two steps of the body, in seconds (``PAYMENTS_PAUSE``).
PAUSE = float(os.environ.get("PAYMENTS_PAUSE", "0.1"))


def _pause() -> None:
    time.sleep(random.uniform(0, PAUSE))  # noqa: S311 (not crypto)


def charge(order_id: int) -> None:
    from charges.models import Charge, Order

    with transaction.atomic():
        order = Order.objects.select_for_update().get(pk=order_id)
        _pause()
        Charge.objects.create(order=order, cents=order.cents)
        _pause()
        order.charged = True
        order.save(update_fields=["charged"])
    _pause()  # the receipt


charge_task = shared_task(name="charges.charge", **OPTIONS[settings.VARIANT])(charge)
