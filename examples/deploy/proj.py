"""The app the deploy recipes run (``celery -A proj …``), with its probe ports.

A beat serves ``/metrics``, ``/healthz`` and ``/readyz`` on
``exactonce_metrics_port`` (9808), a worker on
``exactonce_worker_metrics_port`` (9809): the ports the Kubernetes probes,
the container's ``HEALTHCHECK`` and ``celery -A proj exactonce probe`` ask.
What differs between machines comes from the environment, each with the
recipes' value as its default:

``PROJ_BROKER_URL``           the broker (``redis://redis:6379/0``);
``PROJ_STORE_URL``            the job store (``redis://redis:6379/1``);
``PROJ_METRICS_PORT``         beat's port (``9808``);
``PROJ_WORKER_METRICS_PORT``  a worker's port (``9809``).
"""

from __future__ import annotations

import os

from celery import Celery

from celery_exactonce import ExactOnceTask

app = Celery("proj", broker=os.environ.get("PROJ_BROKER_URL", "redis://redis:6379/0"))
app.conf.beat_scheduler = "exactonce"
app.conf.exactonce_store_url = os.environ.get("PROJ_STORE_URL", "redis://redis:6379/1")
app.conf.exactonce_metrics_port = int(os.environ.get("PROJ_METRICS_PORT", "9808"))
app.conf.exactonce_worker_metrics_port = int(os.environ.get("PROJ_WORKER_METRICS_PORT", "9809"))
app.conf.beat_schedule = {"tick": {"task": "proj.tick", "schedule": 10.0}}


@app.task(base=ExactOnceTask)
def tick() -> None:
    """Runs once per occurrence, whichever beat sent it."""
