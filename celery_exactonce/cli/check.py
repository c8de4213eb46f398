"""``celery exactonce check``: every start-up check of a worker and a beat node, and more.

One line per check: ``ok``, ``warn`` or ``FAIL``, with what was found; a
failure names the setting at fault, as a node refusing to start would
(:mod:`celery_exactonce.startup`, whose checks run here). Exit 1 if any check
failed. Nothing is written: the store is read, not set up (``migrate`` sets
it up, as a node does at start).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable
from typing import Any

import click

from celery_exactonce import config as config_module
from celery_exactonce import runtime, startup
from celery_exactonce.beat import stored
from celery_exactonce.beat.checks import check_beat_entry, fixed_names, uses_django_rows
from celery_exactonce.beat.scheduler import internal_entries
from celery_exactonce.cli import base
from celery_exactonce.config import ExactOnceConfig, UnknownSettingWarning
from celery_exactonce.core import exceptions
from celery_exactonce.reconcile import task as reconcile_task
from celery_exactonce.stores import open_store, redact_url, signing
from celery_exactonce.stores.base import StateStore, format_written
from celery_exactonce.task.gate import validate_gated_task

OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclasses.dataclass
class Check:
    """One line of the report."""

    name: str
    status: str
    message: str
    setting: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Report:
    """The checks run so far."""

    def __init__(self) -> None:
        self.checks: list[Check] = []
        #: The settings once read, redacted (:meth:`ExactOnceConfig.redacted`).
        self.settings: dict[str, Any] | None = None

    def add(self, name: str, status: str, message: str, setting: str | None = None) -> None:
        self.checks.append(Check(name, status, message, setting))

    def run(self, name: str, check: Callable[[], str | tuple[str, str]]) -> bool:
        """``check()``'s message (or ``(status, message)``) as a line; an error as ``FAIL``."""
        try:
            result = check()
        except exceptions.ConfigurationError as exc:
            self.add(name, FAIL, base.setting_message(exc), exc.setting)
            return False
        except exceptions.StoreError as exc:
            text = f"the store of exactonce_store_url: {base.one_line(exc)}"
            self.add(name, FAIL, text, "exactonce_store_url")
            return False
        except exceptions.ExactOnceError as exc:
            self.add(name, FAIL, base.one_line(exc))
            return False
        except Exception as exc:  # a check that could not run is a failed one
            self.add(name, FAIL, f"{type(exc).__name__}: {base.one_line(exc)}")
            return False
        status, message = result if isinstance(result, tuple) else (OK, result)
        self.add(name, status, message)
        return status != FAIL

    @property
    def failed(self) -> bool:
        return any(check.status == FAIL for check in self.checks)


def run_checks(app: Any) -> Report:
    """Every check, in order; those that need the settings or the store stop without them."""
    report = Report()
    holder: dict[str, ExactOnceConfig] = {}

    def settings() -> str:
        with warnings.catch_warnings():  # "setting names" reports them, as a failure
            warnings.simplefilter("ignore", UnknownSettingWarning)
            config = holder["config"] = runtime.config_for(app)
        report.settings = config.redacted()
        return f"store {redact_url(config.store_url)}, namespace {config.namespace!r}"

    if report.run("settings", settings):
        reconcile_task.register_task(app)  # as a worker and beat do: beat's own entry runs it
    report.run("setting names", lambda: _names(app))
    report.run("broker", lambda: _broker(app))
    config = holder.get("config")
    if config is None:
        return report  # the rest reads the settings
    report.run("metrics", lambda: _metrics(config))
    tasks = startup.gated_tasks(app)
    report.run("gated tasks", lambda: _gated(tasks))
    if tasks:
        report.run("retention", lambda: _retention(app, config))
    report.run("beat entries", lambda: _entries(app, config))
    if uses_django_rows(app):
        report.run("periodic tasks", lambda: _rows(app, config))
    report.run("signing", lambda: _signing(config))
    try:
        store = signing.signed(open_store(config, setup=False), config.signing_key)
    except exceptions.ExactOnceError as exc:
        error = exc
        report.run("store", lambda: _raise(error))
        return report
    try:
        report.run("one host", lambda: _one_host(config, store))
        if report.run("store reachable", lambda: _reachable(store, config)):
            report.run("schema", lambda: _schema(store))
            report.run("eviction", lambda: _eviction(store))
            report.run("replicas", lambda: _replicas(store, config))
            report.run("clock", lambda: _clock(store, config))
            if not uses_django_rows(app):
                report.run("stored entries", lambda: _stored(app, config, store))
    finally:
        store.close()
    return report


def _raise(error: BaseException) -> str:
    raise error


def _names(app: Any) -> str:
    """Every ``exactonce_*`` setting is one this version knows (a typo leaves a default)."""
    unknown = config_module.unknown_of(app)
    if unknown:
        raise exceptions.ConfigurationError(
            "; ".join(item.message for item in unknown), setting=unknown[0].key
        )
    return "every exactonce_* setting is a known one"


def _metrics(config: ExactOnceConfig) -> str:
    """Each ``/metrics`` port set binds on ``exactonce_metrics_addr`` now (bound, released)."""
    ports = [
        (role, setting, port)
        for role, setting, port in (
            ("beat", "exactonce_metrics_port", config.metrics_port),
            ("a worker", "exactonce_worker_metrics_port", config.worker_metrics_port),
        )
        if port is not None
    ]
    if not ports:
        return "no /metrics endpoint (exactonce_metrics_port, exactonce_worker_metrics_port unset)"
    served = []
    for role, setting, port in ports:
        where = startup.prometheus_module(setting).probe(port, config.metrics_addr, setting=setting)
        served.append(f"{role} serves /metrics on {where}")
    return "; ".join(served) + " (free now)"


def _broker(app: Any) -> str:
    startup.check_broker(app)
    scheme = startup.broker_scheme(app.conf.broker_write_url or app.conf.broker_url)
    if scheme in startup.AMQP_SCHEMES:
        return "confirm_publish is on: a publish RabbitMQ did not take raises"
    return f"broker {scheme or '(none)'}://: no publisher confirms to turn on"


def _gated(tasks: list[Any]) -> str | tuple[str, str]:
    for task in tasks:
        validate_gated_task(task)
    if not tasks:
        return WARN, "no ExactOnceTask registered: no worker-side gate (dispatch only)"
    names = sorted(str(task.name) for task in tasks)
    return f"{len(names)} gated task(s): {', '.join(names)}"


def _retention(app: Any, config: ExactOnceConfig) -> str:
    startup.check_retention(app, config)
    horizon = startup.redelivery_horizon(app)
    if horizon is None:
        return f"exactonce_retention {config.retention:g} s; the broker has no redelivery horizon"
    return f"exactonce_retention {config.retention:g} s >= the broker's visibility_timeout"


def _entries(app: Any, config: ExactOnceConfig) -> str:
    """Each ``beat_schedule`` entry as beat checks it at start (a bad one names itself)."""
    schedule = {**(app.conf.beat_schedule or {}), **internal_entries(config)}
    internal = set(internal_entries(config))
    for name, fields in schedule.items():
        check_beat_entry(app, config, name, fields, internal=name in internal)
    return f"{len(schedule) - len(internal)} entry(ies) of beat_schedule accepted"


def _stored(app: Any, config: ExactOnceConfig, store: StateStore) -> str | tuple[str, str]:
    """Each stored entry as beat checks it; one named as a ``beat_schedule`` entry refuses
    beat's start, any other bad one is refused alone (beat runs the others)."""
    try:
        _, found = store.read_entries()
    except exceptions.StoreError as exc:  # an SQL store set up before they existed
        return WARN, f"not read ({base.one_line(exc)}); on SQL, `exactonce migrate` makes it"
    if clashes := sorted(set(found) & fixed_names(app, config)):
        raise exceptions.ConfigurationError(
            f"stored entries {clashes} have the names of beat_schedule entries: beat refuses "
            "to start; rename one, or remove the stored one (exactonce schedule remove NAME)",
            setting="beat_schedule",
        )
    refused = []
    for name, text in sorted(found.items()):
        try:
            check_beat_entry(app, config, name, stored.entry_fields(name, stored.parse(name, text)))
        except exceptions.ConfigurationError as exc:
            refused.append(str(exc))
    return _accepted(refused, len(found), "stored entry(ies)", "entries")


def _rows(app: Any, config: ExactOnceConfig) -> str:
    """Each enabled django-celery-beat row as beat checks it; every refused one, named.

    First what refuses the scheduler at start (a custom ``Entry``, SQLite
    without ``IMMEDIATE``). Beat runs the others and refuses these, one by one (an ``entry_refused``
    error each): this check fails so that they are found before that.
    """
    from celery_exactonce.contrib import django_celery_beat, periodic_tasks

    scheduler = app.conf.beat_scheduler
    django_celery_beat.check_start(
        scheduler if isinstance(scheduler, type) else django_celery_beat.DatabaseScheduler
    )
    rows = periodic_tasks.enabled_rows()
    refused: list[str] = []
    for row in rows:
        try:
            fields = periodic_tasks.entry_of(row)
            periodic_tasks.check_task(app, row.name, fields)
            check_beat_entry(app, config, row.name, fields)
        except exceptions.ConfigurationError as exc:
            refused.append(str(exc))
        except Exception as exc:  # a row no check foresaw: still that row's
            refused.append(f"periodic task {row.name!r}: {type(exc).__name__}: {exc}")
    what = "enabled row(s) of django_celery_beat.PeriodicTask"
    return _accepted(refused, len(rows), what, "django_celery_beat.PeriodicTask")


def _accepted(refused: list[str], total: int, what: str, setting: str) -> str:
    """``total`` of ``what`` accepted; else a refusal naming each refused one (beat runs the
    others, refusing these one by one: this check fails so that they are found first)."""
    if refused:
        raise exceptions.ConfigurationError(
            f"{len(refused)} of {total} {what} refused (beat runs the others): "
            + "; ".join(refused),
            setting=setting,
        )
    return f"{total} {what} accepted"


def _signing(config: ExactOnceConfig) -> str | tuple[str, str]:
    if config.signing_key is None:
        return (
            WARN,
            "exactonce_signing_key is not set: stored payloads are unsigned, and anyone "
            "who can write the store can make workers run any task",
        )
    return "stored payloads are signed (exactonce_signing_key)"


def _one_host(config: ExactOnceConfig, store: StateStore) -> str | tuple[str, str]:
    scheme = config.store_url.split("://", 1)[0].lower().split("+", 1)[0]
    if scheme == "memory":
        return (
            WARN,
            "exactonce_store_url is memory://: each process has its own store, "
            "nothing is shared between nodes (tests only)",
        )
    engine = getattr(store, "engine", None)
    if engine is not None and engine.dialect.name == "sqlite":
        return (
            WARN,
            "the store is a SQLite file: every beat and worker must run on this one host "
            "(use Redis, PostgreSQL or MySQL for several hosts)",
        )
    return "the store is shared over the network: nodes may run on several hosts"


def _reachable(store: StateStore, config: ExactOnceConfig) -> str:
    """The store answers: named by its redacted URL and namespace (never a Python repr)."""
    store.now()
    return f"{redact_url(config.store_url)} answers (namespace {store.namespace!r})"


def _schema(store: StateStore) -> str | tuple[str, str]:
    version = store.schema_version()
    if version is None:
        return (
            WARN,
            "the store was never set up: a worker or beat sets it up at start, "
            "or run `celery -A APP exactonce migrate`",
        )
    written = format_written(store)
    if version > written:
        raise exceptions.ConfigurationError(
            f"the store holds format {version}, newer than this code's {written}: "
            "upgrade celery-exactonce",
            setting="exactonce_store_url",
        )
    if version < written:
        return WARN, f"format {version}: run `celery -A APP exactonce migrate` to upgrade"
    return f"format {version} (this code writes {written})"


def _eviction(store: StateStore) -> str:
    check = getattr(store, "check_config", None)
    if check is None:
        return "the store never evicts records"
    check(replicas=False)  # Redis: maxmemory-policy must be noeviction
    return "maxmemory-policy allows no eviction (or is not readable: see the log)"


def _replicas(store: StateStore, config: ExactOnceConfig) -> str:
    """``exactonce_min_replicas``: each master holding the namespace has that many replicas.

    One master (a server, Sentinel's) or, on a cluster, the master of each of
    the namespace's slots, named by its address.
    """
    if not config.min_replicas:
        return "writes wait for no replica (exactonce_min_replicas = 0)"
    counts = store.check_replicas()  # type: ignore[attr-defined]  # only Redis gets here
    if len(counts) == 1 and redact_url(config.store_url) in counts:
        found = f"{next(iter(counts.values()))} replica(s) connected"
    else:
        found = "replicas connected: " + ", ".join(f"master {m} has {n}" for m, n in counts.items())
    return f"{found}; each counted write waits for {config.min_replicas} (exactonce_min_replicas)"


def _clock(store: StateStore, config: ExactOnceConfig) -> str | tuple[str, str]:
    """This host's clock against the store's, within ``exactonce_max_skew``."""
    before = time.time()
    store_now = store.now().timestamp()
    after = time.time()
    offset = store_now - (before + after) / 2
    slack = (after - before) / 2
    text = f"offset {offset:+.3f} s (± {slack:.3f}) against the store's clock"
    if abs(offset) - slack > config.max_skew:
        raise exceptions.ConfigurationError(
            f"this host's clock is {offset:+.3f} s off the store's, over "
            f"exactonce_max_skew ({config.max_skew:g} s): synchronise it (NTP)",
            setting="exactonce_max_skew",
        )
    if abs(offset) - slack > config.max_skew / 2:
        return WARN, f"{text}: over half of exactonce_max_skew ({config.max_skew:g} s)"
    return text


@click.command()
@base.json_option
@click.pass_context
def check(ctx: click.Context, as_json: bool) -> None:
    """Run every start-up check of a worker and a beat node; exit 1 if one fails.

    Settings, setting names (a misspelt one fails, naming the setting meant),
    publisher confirms, the /metrics ports (bound and released), gated tasks,
    retention, beat entries (and django-celery-beat's rows under the
    exactonce-django scheduler), signing, one-host stores, store reachability,
    schema, Redis eviction policy and the clock offset against the store.
    Nothing is written.
    """
    report = run_checks(base.app_of(ctx))
    if as_json:
        checks = [c.as_dict() for c in report.checks]
        base.emit_json({"ok": not report.failed, "checks": checks, "settings": report.settings})
    else:
        width = max(len(c.name) for c in report.checks)
        for c in report.checks:
            click.echo(f"{c.status:<4}  {c.name.ljust(width)}  {c.message}")
        failed = sum(c.status == FAIL for c in report.checks)
        warned = sum(c.status == WARN for c in report.checks)
        verdict = f"{failed} check(s) failed" if failed else "all checks passed"
        click.echo(f"{verdict}, {warned} warning(s)" if warned else verdict)
    ctx.exit(base.EXIT_FAILED if report.failed else base.EXIT_OK)
