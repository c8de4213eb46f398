"""Start-up validation of a worker or beat node (docs/reference/settings.md).

Each failure stops start-up with a :class:`~celery_exactonce.exceptions.ConfigurationError`
naming the setting: it is far cheaper to refuse to start than to discover a
double run in production.
"""

from __future__ import annotations

from typing import Any

from celery import signals

from celery_exactonce import config, exceptions, reconciler, runtime
from celery_exactonce.task import ExactOnceTask, validate_gated_task

#: Broker schemes that speak AMQP, where publisher confirms must be on.
AMQP_SCHEMES = ("amqp", "amqps", "pyamqp")


def check_broker(app: Any) -> None:
    """On RabbitMQ, publishes must be confirmed, or a lost publish looks like a sent one."""
    url = str(app.conf.broker_url or "")
    scheme = url.split("://", 1)[0].split("+", 1)[0].lower()
    if scheme in AMQP_SCHEMES:
        options = app.conf.broker_transport_options or {}
        if not options.get("confirm_publish"):
            raise exceptions.ConfigurationError(
                "broker_transport_options must set confirm_publish=True on an AMQP broker: "
                "without publisher confirms a publish that never reached RabbitMQ is "
                "indistinguishable from one that did",
                setting="broker_transport_options",
            )


def gated_tasks(app: Any) -> list[ExactOnceTask]:
    return [task for task in app.tasks.values() if isinstance(task, ExactOnceTask)]


def check_worker(app: Any) -> None:
    """Everything a worker that runs gated tasks must have right before it consumes.

    A worker of an app that sets ``exactonce_store_url`` also gets the
    reconciler's task (``exactonce_reconcile_on = "worker"`` sends it there).
    """
    if config.settings_of(app).get("exactonce_store_url"):
        reconciler.register_task(app)
    tasks = gated_tasks(app)
    if not tasks:
        return
    runtime.config_for(app)
    check_broker(app)
    for task in tasks:
        validate_gated_task(task)
    runtime.runtime_for(app)  # opens the store: schema, Redis eviction policy, reachability


def _on_worker_init(sender: Any = None, **_kw: Any) -> None:
    app = getattr(sender, "app", None)
    if app is not None:
        check_worker(app)


signals.worker_init.connect(_on_worker_init, weak=False)
