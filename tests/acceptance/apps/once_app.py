"""The control beside unique_app: the same holding task on celery-once's ``QueueOnce``.

Configured from the same ``EXACTONCE_UNIQ_*`` variables as
:mod:`tests.acceptance.apps.unique_app` (its lock in the broker's Redis, under
celery-once's default lock timeout of an hour). ``python -m
tests.acceptance.apps.once_app KEY``: one ``hold.delay(KEY)``; exit 3 when
celery-once refused it (``AlreadyQueued``), printing the seconds its lock has left.
"""

from __future__ import annotations

import os
import sys

from celery import Celery
from celery_once import AlreadyQueued, QueueOnce

from tests.acceptance.apps.holding import held

#: celery-once's default lock timeout (``default_timeout``): an hour.
LOCK_TIMEOUT = 60 * 60

broker = os.environ.get("EXACTONCE_UNIQ_BROKER", "redis://127.0.0.1:6379/9")
app = Celery("once_app", set_as_current=False)
app.conf.update(
    broker_url=broker,
    task_default_queue=os.environ.get("EXACTONCE_UNIQ_QUEUE", "unique"),
    task_ignore_result=True,
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    ONCE={
        "backend": "celery_once.backends.Redis",
        "settings": {"url": broker, "default_timeout": LOCK_TIMEOUT},
    },
)


@app.task(base=QueueOnce, bind=True, name="once_app.hold", once={"keys": ["key"]})
def hold(self: QueueOnce, key: str) -> None:
    held(self.request.id, key)


if __name__ == "__main__":  # KEY: one call; exit 3, the lock's seconds left, if refused
    try:
        hold.delay(sys.argv[1])
    except AlreadyQueued as refused:
        print(refused.countdown)
        sys.exit(3)
