"""A Celery app for the CLI's tests, configured from the environment.

``celery -A tests.cli.cli_app exactonce …`` runs the real command on it:

``EXACTONCE_CLI_STORE_URL``   ``exactonce_store_url``
``EXACTONCE_CLI_NAMESPACE``   ``exactonce_namespace``
``EXACTONCE_CLI_CONF``        JSON object of further settings, applied last

With ``DJANGO_SETTINGS_MODULE`` set, Django is set up first (a project's
Celery app does it in its ``celery.py``), for a ``django://`` store.

The broker is kombu's in-memory transport: no command here connects to it
(a reconcile pass with nothing stale publishes nothing).
"""

from __future__ import annotations

import json
import os
from typing import Any

from celery import Celery
from celery.schedules import crontab

if os.environ.get("DJANGO_SETTINGS_MODULE"):
    import django

    django.setup()

from celery_exactonce.task.base import ExactOnceTask

#: The beat entry the tests' occurrences belong to.
NIGHTLY = "nightly-billing"

app = Celery("cli_app")
app.conf.update(
    broker_url="memory://",
    result_backend=None,
    task_ignore_result=True,
    timezone="UTC",
    exactonce_store_url=os.environ.get("EXACTONCE_CLI_STORE_URL", "memory://"),
    exactonce_namespace=os.environ.get("EXACTONCE_CLI_NAMESPACE", "default"),
    beat_schedule={
        NIGHTLY: {"task": "cli_app.bill", "schedule": crontab(minute="0", hour="3")},
    },
)
if os.environ.get("EXACTONCE_CLI_CONF"):
    app.conf.update(json.loads(os.environ["EXACTONCE_CLI_CONF"]))


@app.task(base=ExactOnceTask, name="cli_app.bill")
def bill(*args: Any) -> None:
    """Never runs here: the tests only look at and act on its jobs."""


@app.task(base=ExactOnceTask, name="cli_app.mail")
def mail(*args: Any) -> None:
    """Never runs here."""
