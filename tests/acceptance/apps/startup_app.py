"""A Celery app with one gated task, configured from the environment, for start-up refusals.

``celery -A tests.acceptance.apps.startup_app worker`` (or ``beat -S exactonce``)
starts it with whatever settings ``tests/acceptance/test_startup_refusals.py`` gives:

``EXACTONCE_SU_BROKER_URL``        ``broker_url``
``EXACTONCE_SU_QUEUE``             ``task_default_queue`` (unique per test)
``EXACTONCE_SU_STORE_URL``         ``exactonce_store_url``; unset: the app has none
``EXACTONCE_SU_NAMESPACE``         ``exactonce_namespace``
``EXACTONCE_SU_CONF``              JSON object of further settings (``broker_transport_options``,
                                   ``exactonce_*``…), applied last
``EXACTONCE_SU_REJECT_ON_LOST``    ``1``: the gated task sets ``reject_on_worker_lost=True``

It imports only :mod:`celery_exactonce.task.base`, never the package's top level
explicitly: the start-up checks must not depend on what the app imports.
"""

from __future__ import annotations

import json
import os
from typing import Any

from celery import Celery

from celery_exactonce.task.base import ExactOnceTask

app = Celery("startup_app")
app.conf.update(
    broker_url=os.environ.get("EXACTONCE_SU_BROKER_URL"),
    broker_connection_retry_on_startup=False,
    result_backend=None,
    task_ignore_result=True,
    task_default_queue=os.environ.get("EXACTONCE_SU_QUEUE", "celery"),
    worker_send_task_events=False,
    exactonce_namespace=os.environ.get("EXACTONCE_SU_NAMESPACE", "default"),
)
if os.environ.get("EXACTONCE_SU_STORE_URL"):
    app.conf.exactonce_store_url = os.environ["EXACTONCE_SU_STORE_URL"]
if os.environ.get("EXACTONCE_SU_CONF"):
    app.conf.update(json.loads(os.environ["EXACTONCE_SU_CONF"]))


@app.task(
    base=ExactOnceTask,
    name="startup_app.gated",
    reject_on_worker_lost=os.environ.get("EXACTONCE_SU_REJECT_ON_LOST") == "1",
)
def gated(*args: Any) -> None:
    """Never runs: every test here expects the process to refuse to start."""
