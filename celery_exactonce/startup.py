"""Start-up checks of a worker or beat node: refuse to start rather than run a job twice.

Each check raises :class:`~celery_exactonce.core.exceptions.ConfigurationError`
naming the setting: it is far cheaper to refuse to start than to discover a
double run in production.

Under ``celery worker`` and ``celery beat`` a refusal ends the process before
it consumes a message or claims a slot: one line on stderr naming the setting,
exit status 1 (:class:`StartupRefused`), the traceback at debug level only.

* The worker runs :func:`check_worker` from Celery's ``worker_init`` signal,
  connected when the package is imported (any app that defines an
  :class:`~celery_exactonce.task.base.ExactOnceTask` imports it, whichever module it
  imports). Celery logs and swallows an exception raised by a signal receiver,
  so the receiver ends the process itself: :class:`StartupRefused` is a
  ``SystemExit``, which Celery lets through.
* Beat runs :func:`check_beat` as :class:`~celery_exactonce.beat.scheduler.ExactOnceScheduler`
  is built (:func:`start_beat`), before its first tick.
* The Prometheus endpoints start here too, refused the same way when they
  cannot (a port taken, the ``prometheus`` extra missing): beat's
  (:func:`serve_beat_metrics`) and a worker's main process's
  (:func:`serve_worker_metrics`, after :func:`check_worker`).
"""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Callable, Mapping
from datetime import tzinfo
from typing import Any, NoReturn

from celery import signals

from celery_exactonce import config, runtime
from celery_exactonce.core import exceptions
from celery_exactonce.observe import gauges, metrics
from celery_exactonce.observe.entry_health import EntryHealthReader
from celery_exactonce.observe.health import BeatProbes, WorkerProbes
from celery_exactonce.reconcile import task as reconcile_task
from celery_exactonce.stores.unique import keeps_unique
from celery_exactonce.task import atomic, unique
from celery_exactonce.task.base import ExactOnceTask
from celery_exactonce.task.gate import validate_gated_task

#: Broker schemes that speak AMQP, where publisher confirms must be on.
AMQP_SCHEMES = ("amqp", "amqps", "pyamqp")

#: Broker schemes whose transport redelivers a message left unacknowledged for
#: ``broker_transport_options["visibility_timeout"]`` seconds, with kombu's
#: default timeout. On AMQP a message is redelivered only once the consumer's
#: connection is gone, however long it was held: there is no such horizon.
REDELIVERY_HORIZONS: dict[str, float] = {
    "redis": 3600.0,
    "rediss": 3600.0,
    "sentinel": 3600.0,
    "sqs": 1800.0,
}

#: Exit status of a node that refused to start.
EXIT_STATUS = 1


class StartupRefused(SystemExit):
    """A node refused to start; ``error`` says why (Celery lets a ``SystemExit`` through).

    Attributes
    ----------
    role:
        ``"worker"`` or ``"beat"``.
    error:
        The refused check's error (a :class:`ConfigurationError` naming the
        setting, or the :class:`StoreError` of a store that cannot be opened).
    """

    def __init__(self, role: str, error: BaseException) -> None:
        self.role = role
        self.error = error
        super().__init__(EXIT_STATUS)


def broker_scheme(url: object) -> str:
    """The scheme of a broker URL (the first one of a fail-over list), lower-case, no ``+…``."""
    if isinstance(url, (list, tuple)):
        url = url[0] if url else ""
    text = str(url or "").split(";", 1)[0].strip()
    if "://" not in text:
        return ""
    return text.split("://", 1)[0].split("+", 1)[0].lower()


def check_broker(app: Any) -> None:
    """On RabbitMQ, publishes must be confirmed, or a lost publish looks like a sent one."""
    scheme = broker_scheme(app.conf.broker_write_url or app.conf.broker_url)
    if scheme in AMQP_SCHEMES:
        options = app.conf.broker_transport_options or {}
        if not options.get("confirm_publish"):
            raise exceptions.ConfigurationError(
                "broker_transport_options must set confirm_publish=True on an AMQP broker: "
                "without publisher confirms a publish that never reached RabbitMQ is "
                "indistinguishable from one that did",
                setting="broker_transport_options",
            )


def redelivery_horizon(app: Any) -> float | None:
    """Seconds after which the broker redelivers an unacknowledged message, if it does.

    ``broker_transport_options["visibility_timeout"]`` (or the transport's
    default) on Redis and SQS; ``None`` on brokers without such a timeout
    (AMQP redelivers only when the consumer's connection is gone).
    """
    scheme = broker_scheme(app.conf.broker_read_url or app.conf.broker_url)
    default = REDELIVERY_HORIZONS.get(scheme)
    if default is None:
        return None
    value = (app.conf.broker_transport_options or {}).get("visibility_timeout", default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise exceptions.ConfigurationError(
            "broker_transport_options visibility_timeout must be a number of seconds, "
            f"got {value!r}",
            setting="broker_transport_options",
        )
    return float(value)


def check_retention(app: Any, settings: config.ExactOnceConfig) -> None:
    """A worker's records (occurrences' too) must outlive the broker's redelivery horizon.

    The gate adopts a message sent without celery-exactonce's headers by
    creating its record; a copy of that message redelivered after the record
    was purged (``exactonce_retention``) would find none and run again.
    """
    horizon = redelivery_horizon(app)
    if horizon is not None and settings.retention < horizon:
        raise exceptions.ConfigurationError(
            f"exactonce_retention ({settings.retention:g} s) must be >= the broker's "
            f"visibility_timeout ({horizon:g} s): a message adopted at the gate and "
            "redelivered after its record was purged would run again",
            setting="exactonce_retention",
        )
    kept = settings.occurrence_retention
    if horizon is not None and kept is not None and kept < horizon:
        raise exceptions.ConfigurationError(
            f"exactonce_occurrence_retention ({kept:g} s) must be >= the broker's "
            f"visibility_timeout ({horizon:g} s): an occurrence's message redelivered after "
            "its record was purged would be refused at the gate as a record the store lost",
            setting="exactonce_occurrence_retention",
        )


def gated_tasks(app: Any) -> list[ExactOnceTask]:
    return [task for task in app.tasks.values() if isinstance(task, ExactOnceTask)]


def check_worker(app: Any) -> None:
    """Everything a worker that runs gated tasks must have right before it consumes.

    A worker of an app that sets ``exactonce_store_url`` also gets the
    reconciler's task (``exactonce_reconcile_on = "worker"`` sends it there).

    Raises
    ------
    ConfigurationError
        A setting is refused; the message names it.
    StoreError
        The store cannot be opened (unreachable, or of a newer format).
    """
    if config.settings_of(app).get("exactonce_store_url"):
        reconcile_task.register_task(app)
    tasks = gated_tasks(app)
    if not tasks:
        return
    settings = runtime.config_for(app)
    check_broker(app)
    check_retention(app, settings)
    for task in tasks:
        validate_gated_task(task)
    store = runtime.runtime_for(app).store  # opened: schema, Redis eviction, reachability
    for task in tasks:
        if getattr(task, "exactonce_atomic", False):
            atomic.check_store(task, store)
        if unique.spec_of(task) is not None and not keeps_unique(store):
            raise exceptions.ConfigurationError(
                f"{task.name}.exactonce_unique: the store of exactonce_store_url keeps no "
                "unique keys (a sharded Redis: exactonce_shards)",
                setting="exactonce_unique",
            )


def check_beat(app: Any) -> runtime.Runtime:
    """What a beat node must have right before its first tick; returns its runtime.

    The settings, publisher confirms on AMQP, the gated tasks it knows, and
    the store (reachable, set up, Redis without eviction). Raises as
    :func:`check_worker`.
    """
    runtime.config_for(app)
    check_broker(app)
    for task in gated_tasks(app):
        validate_gated_task(task)
    return runtime.runtime_for(app)


def refusal_line(role: str, error: BaseException) -> str:
    """The one line a refusing node writes: what it is and the setting at fault."""
    text = " ".join(str(error).split())
    if isinstance(error, exceptions.ConfigurationError):
        if error.setting and error.setting not in text:
            text = f"{text} (setting {error.setting})"
    elif isinstance(error, exceptions.StoreError):
        text = f"the store of exactonce_store_url cannot be opened: {text}"
    else:
        text = f"the start-up checks failed: {type(error).__name__}: {text}"
    return f"celery-exactonce: {role} refused to start: {text}"


def refuse(role: str, error: BaseException) -> NoReturn:
    """End start-up: one line on stderr, the traceback at debug, :class:`StartupRefused`."""
    metrics.event(
        "startup_refused",
        f"{role} refused to start: {error}",
        level=logging.DEBUG,
        labels={"where": role},
        exc_info=error,
    )
    try:
        sys.stderr.write(refusal_line(role, error) + "\n")
        if not isinstance(error, exceptions.ExactOnceError):  # a bug, not a setting
            traceback.print_exception(error, file=sys.stderr)
        sys.stderr.flush()
    except (OSError, ValueError):  # no usable stderr (a detached process): still refuse
        pass
    raise StartupRefused(role, error) from error


def start_beat(app: Any) -> runtime.Runtime:
    """:func:`check_beat`, ending the process on a refusal (:func:`refuse`)."""
    try:
        return check_beat(app)
    except Exception as exc:  # any failure here must stop beat cleanly
        refuse("beat", exc)


def prometheus_module(setting: str) -> Any:
    """The module :mod:`celery_exactonce.observe.prometheus`, or a refusal naming ``setting``."""
    try:
        from celery_exactonce.observe import prometheus
    except ImportError as exc:
        raise exceptions.ConfigurationError(
            f"{setting} is set but prometheus-client is not installed: "
            "pip install 'celery-exactonce[prometheus]'",
            setting=setting,
        ) from exc
    return prometheus


def serve_beat_metrics(
    rt: runtime.Runtime,
    beat: gauges.BeatGauges,
    entries: Callable[[], Mapping[str, Any]],
    tz: tzinfo,
) -> Any:
    """Beat's ``/metrics`` on ``exactonce_metrics_port`` (``None``: unset); refuses on failure.

    ``entries`` gives beat's schedule (a copy: the gauge thread calls it), whose
    entries' health the endpoint shows.
    """
    settings = rt.config
    if settings.metrics_port is None:
        return None
    health = EntryHealthReader(rt.store, entries, tz=tz, periods=settings.overdue_periods)
    try:
        return prometheus_module("exactonce_metrics_port").serve_beat(
            rt.store,
            beat,
            port=settings.metrics_port,
            addr=settings.metrics_addr,
            reconcile_here=settings.reconcile_on == "beat",
            health=health,
            probes=BeatProbes(beat, settings.tick_interval),
        )
    except Exception as exc:  # a taken port, no extra: beat must not start blind
        refuse("beat", exc)


def serve_worker_metrics(worker: Any) -> Any:
    """A worker's ``/metrics`` on ``exactonce_worker_metrics_port`` (``None`` when unset)."""
    app = worker.app
    if not config.settings_of(app).get("exactonce_worker_metrics_port"):
        return None
    settings = runtime.config_for(app)
    from celery.concurrency import get_implementation
    from celery.concurrency.prefork import TaskPool

    pool = get_implementation(worker.pool_cls)
    prefork = isinstance(pool, type) and issubclass(pool, TaskPool)
    server = prometheus_module("exactonce_worker_metrics_port").serve_worker(
        port=settings.worker_metrics_port,
        addr=settings.metrics_addr,
        prefork=prefork,
        probes=WorkerProbes(worker, runtime.runtime_for(app).store.now),
    )
    _worker_servers.append(server)
    return server


#: The worker metrics endpoints this process serves (kept alive with it).
_worker_servers: list[Any] = []


def _on_worker_init(sender: Any = None, **_kw: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None:
        return
    try:
        check_worker(app)
        serve_worker_metrics(sender)
    except Exception as exc:  # Celery would swallow it: the worker must not start
        refuse("worker", exc)


signals.worker_init.connect(_on_worker_init, weak=False)
