"""The quickstart's app (docs/quickstart.md), runnable as it stands.

The page's set-up, with what differs between machines read from the
environment (each has the page's value as its default):

``PROJ_BROKER_URL``  the broker (``redis://localhost:6379/0``);
``PROJ_STORE_URL``   the job store (``redis://localhost:6379/1``);
``PROJ_TICK_EVERY``  seconds between the ``tick`` entry's occurrences (``10``);
``PROJ_LEDGER``      if set, a file each run of a task appends one JSON line to
                     (its task, idempotency key and occurrence), to count runs.
"""

from __future__ import annotations

import json
import os
from typing import Any

from celery import Celery
from celery.schedules import crontab

from celery_exactonce import ExactOnceTask

app = Celery("proj", broker=os.environ.get("PROJ_BROKER_URL", "redis://localhost:6379/0"))
app.conf.beat_scheduler = "exactonce"  # the leaderless scheduler
app.conf.exactonce_store_url = os.environ.get(  # where jobs live
    "PROJ_STORE_URL", "redis://localhost:6379/1"
)
app.conf.task_serializer = "json"
app.conf.accept_content = ["json"]
app.conf.beat_schedule = {
    "nightly-report": {"task": "proj.nightly_report", "schedule": crontab(hour=3, minute=0)},
    "tick": {"task": "proj.tick", "schedule": float(os.environ.get("PROJ_TICK_EVERY", "10"))},
}


def note_run(task: Any) -> None:
    """Print the run, and append it to ``PROJ_LEDGER`` when that is set."""
    headers = task.request.headers or {}
    run = {
        "task": task.name,
        "idempotency_key": task.request.idempotency_key,
        "entry": headers.get("exactonce_key") or getattr(task.request, "exactonce_key", None),
        "fire_time": headers.get("exactonce_fire_time")
        or getattr(task.request, "exactonce_fire_time", None),
        "task_id": task.request.id,
    }
    print(task.name.split(".")[-1], run["idempotency_key"])
    ledger = os.environ.get("PROJ_LEDGER")
    if ledger:
        # One short write per run in append mode: lines from several processes never mix.
        with open(ledger, "a", encoding="utf-8") as out:
            out.write(json.dumps(run) + "\n")


@app.task(base=ExactOnceTask, bind=True)
def nightly_report(self: Any) -> None:
    # The same key on every node and every retry: hand it to what you change.
    note_run(self)


@app.task(base=ExactOnceTask, bind=True)
def tick(self: Any) -> None:
    note_run(self)
