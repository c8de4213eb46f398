"""Gated tasks that retry, requeue or replace themselves inside their own ``transaction.atomic()``.

:func:`register` adds them to a ledger app on a ``django://`` store (the
worker's :mod:`~tests.acceptance.apps.django_app`, and the test's own app that
submits them). On its first attempt each body records a run, opens
``transaction.atomic()`` on Django's ``default`` database (the store's),
creates a ``User`` named after its task id, then leaves the block by:

* ``atomic_retry``: ``self.retry()``;
* ``atomic_requeue``: ``Reject(requeue=True)`` (``acks_late``);
* ``atomic_replace``: ``self.replace()`` with ``gated_record`` (which records a run).

The block rolls back: the user is never there. A later attempt only records its run.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from celery import Celery, Task
from celery.exceptions import Reject

from tests.acceptance.apps import ledger

#: The tasks :func:`register` adds.
TASKS = ("atomic_retry", "atomic_requeue", "atomic_replace")
#: The atomic task it adds too (``exactonce_atomic``): ``atomic_charge(order, seconds)``
#: records its start, creates a ``User`` named ``charge-<order>-…``, sleeps ``seconds``
#: (the window a kill falls in), and records its end.
CHARGE = "atomic_charge"


def note(ledger_path: str, task: Task, phase: str, args: list[Any]) -> None:
    """A row of ``task``'s current run in the ledger (another file than the database: it
    is written whether the run's transaction commits or not)."""
    ledger.append(
        ledger_path,
        task=task.name,
        task_id=task.request.id,
        attempt=int(task.request.retries or 0),
        phase=phase,
        args=args,
        kwargs={},
        meta=None,
    )


def register(app: Celery, ledger_path: str) -> None:
    """Add :data:`TASKS` (``ExactOnceTask``) to ``app``, recording to ``ledger_path``."""
    from celery_exactonce import ExactOnceTask

    def body(self: Task, *args: Any) -> None:
        from django.contrib.auth.models import User
        from django.db import transaction

        attempt = int(self.request.retries or 0)
        ledger.append(
            ledger_path,
            task=self.name,
            task_id=self.request.id,
            attempt=attempt,
            phase="run",
            args=list(args),
            kwargs={},
            meta=None,
        )
        if attempt:
            return
        with transaction.atomic():
            User.objects.create(username=self.request.id)
            if self.name == "atomic_retry":
                raise self.retry(countdown=0, max_retries=3)
            if self.name == "atomic_replace":
                self.replace(app.tasks["gated_record"].s(*args))
            raise Reject("requeued from inside the block", requeue=True)

    for name in TASKS:
        app.task(bind=True, shared=False, base=ExactOnceTask, name=name, acks_late=True)(body)

    def charge(self: Task, order: str, seconds: float) -> None:
        from django.contrib.auth.models import User

        note(ledger_path, self, "start", [order, seconds])  # (written, committed or not)
        User.objects.create(username=f"charge-{order}-{uuid.uuid4().hex[:8]}")
        time.sleep(seconds)
        note(ledger_path, self, "end", [order, seconds])

    app.task(bind=True, shared=False, base=ExactOnceTask, name=CHARGE, exactonce_atomic=True)(
        charge
    )
