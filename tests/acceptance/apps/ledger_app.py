"""A Celery app configured only from the environment, whose tasks log every body run.

``celery -A tests.acceptance.apps.ledger_app worker`` runs it; the test process
builds the same app with :func:`make_app` to send tasks. Every setting comes
from these variables (the harness sets them, see ``harness.Deployment.env``):

``EXACTONCE_ACC_BROKER_URL``           broker (``redis://…/10`` or ``amqp://…``)
``EXACTONCE_ACC_QUEUE``                ``task_default_queue`` (unique per test)
``EXACTONCE_ACC_REDIS_PREFIX``         Redis ``global_keyprefix`` (unique per test)
``EXACTONCE_ACC_STORE_URL``            ``exactonce_store_url``
``EXACTONCE_ACC_NAMESPACE``            ``exactonce_namespace``
``EXACTONCE_ACC_LEDGER``               path of the SQLite ledger (``ledger.py``)
``EXACTONCE_ACC_ACKS_LATE``            ``1`` for ``task_acks_late``
``EXACTONCE_ACC_VISIBILITY_TIMEOUT``   seconds; Redis ``visibility_timeout``

On Redis the unacked-message sweep runs every second
(``unacked_restore_interval=1``, ``unacked_restore_throttle=1``): kombu 5.7's
defaults (10 s x every 10th call) would restore an expired message only about
every 100 s, whatever ``visibility_timeout`` says.

The gated tasks exist only when ``celery_exactonce.ExactOnceTask`` does.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from celery import Celery, Task

from tests.acceptance.apps import ledger

try:
    from celery_exactonce import ExactOnceTask  # type: ignore[attr-defined]
except ImportError:  # the gate is not written yet: only the plain tasks exist
    ExactOnceTask = None

PLAIN_TASKS = ("plain_record", "slow_record")
GATED_TASKS = ("gated_record", "gated_slow", "gated_retry", "gated_autoretry")

#: Redis sweep for expired unacked messages, in seconds (see the module docstring).
REDIS_RESTORE_INTERVAL = 1


def _flag(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def broker_transport_options(env: Mapping[str, str]) -> dict[str, Any]:
    url = env.get("EXACTONCE_ACC_BROKER_URL", "")
    if url.startswith(("amqp://", "pyamqp://", "amqps://")):
        return {"confirm_publish": True}
    if url.startswith(("redis://", "rediss://", "unix://")):
        options: dict[str, Any] = {
            "unacked_restore_interval": REDIS_RESTORE_INTERVAL,
            "unacked_restore_throttle": 1,
        }
        if env.get("EXACTONCE_ACC_VISIBILITY_TIMEOUT"):
            options["visibility_timeout"] = float(env["EXACTONCE_ACC_VISIBILITY_TIMEOUT"])
        if env.get("EXACTONCE_ACC_REDIS_PREFIX"):
            options["global_keyprefix"] = env["EXACTONCE_ACC_REDIS_PREFIX"]
        return options
    return {}


def make_app(env: Mapping[str, str] = os.environ, *, set_as_current: bool = True) -> Celery:
    """The ledger app configured from ``env`` (``os.environ`` in a worker)."""
    app = Celery("ledger_app", set_as_current=set_as_current)
    queue = env.get("EXACTONCE_ACC_QUEUE", "celery")
    app.conf.update(
        broker_url=env.get("EXACTONCE_ACC_BROKER_URL"),
        broker_transport_options=broker_transport_options(env),
        broker_connection_retry_on_startup=True,
        result_backend=None,
        task_ignore_result=True,
        task_default_queue=queue,
        task_acks_late=_flag(env.get("EXACTONCE_ACC_ACKS_LATE")),
        worker_prefetch_multiplier=1,
        worker_send_task_events=False,
        task_serializer="json",
        accept_content=["json"],
        exactonce_store_url=env.get("EXACTONCE_ACC_STORE_URL"),
        exactonce_namespace=env.get("EXACTONCE_ACC_NAMESPACE", "default"),
    )
    if env.get("EXACTONCE_ACC_BEAT_EVERY"):
        # One gated and one plain entry, every N seconds (for `celery beat -S exactonce`).
        every = float(env["EXACTONCE_ACC_BEAT_EVERY"])
        app.conf.beat_schedule = {
            "gated-every": {"task": "gated_record", "schedule": every, "args": ("beat",)},
            "plain-every": {"task": "plain_record", "schedule": every, "args": ("beat",)},
        }
    if env.get("EXACTONCE_ACC_EXTRA_CONF"):
        app.conf.update(json.loads(env["EXACTONCE_ACC_EXTRA_CONF"]))
    # The gate logs suppressed duplicates at debug: let the worker log show them.
    logging.getLogger("celery_exactonce").setLevel(logging.DEBUG)
    ledger_path = env.get("EXACTONCE_ACC_LEDGER", "")
    _register_tasks(app, ledger_path)
    return app


def _record(task: Task, ledger_path: str, phase: str, args: Any, kwargs: Any = None) -> None:
    if not ledger_path:
        raise RuntimeError("EXACTONCE_ACC_LEDGER is not set: nowhere to record the run")
    ledger.append(
        ledger_path,
        task=task.name,
        task_id=task.request.id,
        attempt=task.request.retries or 0,
        phase=phase,
        args=args,
        kwargs=kwargs,
    )


def _register_tasks(app: Celery, ledger_path: str) -> None:
    @app.task(bind=True, shared=False, name="plain_record")
    def plain_record(self: Task, *args: Any, **kwargs: Any) -> None:
        _record(self, ledger_path, "run", args, kwargs)

    @app.task(bind=True, shared=False, name="slow_record")
    def slow_record(self: Task, seconds: float) -> None:
        _record(self, ledger_path, "start", [seconds])
        time.sleep(seconds)  # the window in which a redelivery or a kill happens
        _record(self, ledger_path, "end", [seconds])

    if ExactOnceTask is None:
        return

    @app.task(bind=True, shared=False, base=ExactOnceTask, name="gated_record")
    def gated_record(self: Task, *args: Any, **kwargs: Any) -> None:
        _record(self, ledger_path, "run", args, kwargs)

    @app.task(bind=True, shared=False, base=ExactOnceTask, name="gated_slow")
    def gated_slow(self: Task, seconds: float) -> None:
        _record(self, ledger_path, "start", [seconds])
        time.sleep(seconds)
        _record(self, ledger_path, "end", [seconds])

    @app.task(bind=True, shared=False, base=ExactOnceTask, name="gated_retry")
    def gated_retry(self: Task, n_fail: int, countdown: float, stage: int = 0) -> None:
        """Retries ``n_fail`` times; each retry carries ``stage`` = the next attempt."""
        _record(self, ledger_path, "run", [n_fail, countdown], {"stage": stage})
        retries = self.request.retries or 0
        if retries < n_fail:
            raise self.retry(
                args=(n_fail, countdown),
                kwargs={"stage": retries + 1},
                countdown=countdown,
                max_retries=5,
            )

    @app.task(
        bind=True,
        shared=False,
        base=ExactOnceTask,
        name="gated_autoretry",
        autoretry_for=(RuntimeError,),
        retry_kwargs={"max_retries": 5, "countdown": 1},
        retry_backoff=False,
        retry_jitter=False,
    )
    def gated_autoretry(self: Task, n_fail: int = 2) -> None:
        """Raises ``RuntimeError`` on the first ``n_fail`` attempts."""
        _record(self, ledger_path, "run", [n_fail])
        if (self.request.retries or 0) < n_fail:
            raise RuntimeError(f"attempt {self.request.retries} fails on purpose")


#: The app ``celery -A tests.acceptance.apps.ledger_app worker`` runs.
app = make_app(os.environ)
