"""A Celery app with one unique gated task, configured from the environment.

``celery -A tests.acceptance.apps.unique_app worker`` runs it; the test and
its submitting processes build the same app (``python -m
tests.acceptance.apps.unique_app KEY N OUT``: ``N`` calls of ``hold.delay(KEY)``,
each answer's task id a line of ``OUT``).

``EXACTONCE_UNIQ_BROKER``  the broker; ``EXACTONCE_UNIQ_QUEUE`` its queue
``EXACTONCE_UNIQ_STORE``   ``exactonce_store_url``; ``EXACTONCE_UNIQ_NAMESPACE`` the namespace
``EXACTONCE_UNIQ_DIR``     where a body marks its start (``started-<task id>``) and
                           waits for its release (``release-<key>``)

A RUNNING job is timed out 5 s after its last heartbeat (one a second): a
reconcile pass after a worker's SIGKILL ends it soon.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from celery import Celery

from celery_exactonce import ExactOnceTask
from tests.acceptance.apps.holding import held

app = Celery("unique_app", set_as_current=False)
app.conf.update(
    broker_url=os.environ.get("EXACTONCE_UNIQ_BROKER", "redis://127.0.0.1:6379/9"),
    task_default_queue=os.environ.get("EXACTONCE_UNIQ_QUEUE", "unique"),
    task_ignore_result=True,
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    exactonce_store_url=os.environ.get("EXACTONCE_UNIQ_STORE", "memory://"),
    exactonce_namespace=os.environ.get("EXACTONCE_UNIQ_NAMESPACE", "unique"),
    exactonce_running_timeout=5.0,
    exactonce_heartbeat_interval=1.0,
    exactonce_max_skew=1.0,
)


@app.task(base=ExactOnceTask, bind=True, name="unique_app.hold", exactonce_unique=("key",))
def hold(self: ExactOnceTask, key: str) -> None:
    held(self.request.id, key)


if __name__ == "__main__":  # KEY N OUT: N submissions of hold(KEY), their ids in OUT
    key, count, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    ids = [hold.delay(key).id for _ in range(count)]
    out.write_text("\n".join(ids) + "\n", encoding="utf-8")
