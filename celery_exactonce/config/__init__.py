"""ExactOnceConfig: every ``exactonce_*`` setting, typed, frozen and validated once.

Settings are read from the Celery app's configuration, where they are spelled
with the ``exactonce_`` prefix (``app.conf.exactonce_store_url``); Django
projects that load Celery settings with ``namespace="CELERY"`` write
``CELERY_EXACTONCE_STORE_URL``. :meth:`ExactOnceConfig.from_app` reads them
once at start-up and refuses anything inconsistent with an error that names
the setting (docs/reference/settings.md). The config is then passed explicitly to the
store, the scheduler and the reconciler; nothing is set on the app.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Mapping
from typing import Any, Literal, cast

from celery_exactonce.config import unknown as unknown_settings
from celery_exactonce.core import exceptions, jobs, refs
from celery_exactonce.stores import (
    KNOWN_SCHEMES,
    not_a_store_url,
    redact_url,
    signing,
    validate_namespace,
)

PREFIX = "exactonce_"

Catchup = Literal["latest", "all", "none"]
ReconcileOn = Literal["beat", "worker"]
TerminalHistory = Literal["full", "last", "none"]

_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_TABLE_PREFIX_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,31}$")
#: Most shards a namespace may have: every tick and sweep reads every shard, so a
#: few per master is all a cluster can use (and each finds its tag at start-up).
MAX_SHARDS = 256


#: Where the Prometheus endpoints listen by default: every IPv4 interface, as a scrape
#: target must be reachable (prometheus-client cannot bind ``""``; ``"::"`` adds IPv6
#: where the host has it).
DEFAULT_METRICS_ADDR = "0.0.0.0"  # noqa: S104  (every interface is the point)

UnknownSettingWarning = unknown_settings.UnknownSettingWarning


@dataclasses.dataclass(frozen=True)
class ExactOnceConfig:
    """The settings of celery-exactonce. Durations are in seconds."""

    store_url: str
    """Where jobs live: ``memory://``, ``redis://`` (``rediss://``, ``unix://``,
    ``redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE[/DB]``),
    ``postgresql://``, ``mysql://`` / ``mariadb://``, ``sqlite:///`` (each optionally
    ``+driver``) or ``django://ALIAS``. Required. Credentials in it are redacted
    wherever it is shown."""
    namespace: str = "default"
    """Separates apps sharing one store; part of every key, row and idempotency key, so
    changing it starts an empty history. 1-64 letters, digits, ``_``, ``.``, ``-``,
    starting with a letter or digit."""
    tick_interval: float = 1.0
    """How often a beat node looks for due slots and due delayed jobs. > 0."""
    window_lookback: float = 300.0
    """How far back a tick still claims a missed slot (judged on store time); older
    slots are skipped and counted. > 0."""
    max_skew: float = 5.0
    """Largest clock difference tolerated between a node and the store, or between the
    store's clock before and after a loss. >= 0."""
    catchup: Catchup = "latest"
    """Slots missed during downtime: ``latest`` (only the newest), ``all`` (up to
    ``catchup_limit``) or ``none``. Per entry under ``options["exactonce"]``."""
    catchup_limit: int = 100
    """Most missed slots of one entry that ``catchup="all"`` dispatches (the newest). > 0."""
    max_lateness: float | None = None
    """A slot later than this is skipped (and counted) whatever the catch-up policy.
    > 0, or ``None`` for no limit."""
    retention: float = 7 * 86_400.0
    """How long a terminal record is kept (7 days), from ``max(fire_time, terminal_at)``;
    live records never expire. >= ``window_lookback + tick_interval + max_skew``, and on
    a gated worker with a Redis or SQS broker >= its ``visibility_timeout``."""
    occurrence_retention: float | None = None
    """How long a terminal beat occurrence is kept, from ``max(fire_time, terminal_at)``, when
    shorter than ``retention`` (``None``: as long). Past the look-back it guards nothing: the
    entry's watermark refuses its slot. >= ``window_lookback + tick_interval + max_skew``,
    <= ``retention``, and on a gated worker with a Redis or SQS broker >= its
    ``visibility_timeout``."""
    terminal_history: TerminalHistory = "full"
    """What a terminal record keeps of its history: ``full`` (the capped history a live
    record keeps), ``last`` (the transition that ended the job) or ``none``. Its own
    fields (state, reason, node, times, attempt, key) stay whatever this says."""
    terminal_payload: bool = True
    """Whether a terminal record keeps its payload (args, kwargs, options, signature).
    Off, with ``terminal_history = "none"``, a terminal record is a few hundred bytes."""
    replay_age: float = 60.0
    """A ``SCHEDULED`` job older than this is replayed by the reconciler.
    >= 2 x (``tick_interval`` + ``publish_timeout`` + ``store_timeout``)."""
    dispatch_timeout: float = 300.0
    """A plain job still ``DISPATCHED`` after this ends ``TIMEOUT`` (``unconfirmed``).
    > ``replay_age``."""
    dispatch_deadline: float = 3600.0
    """A gated job still ``DISPATCHED`` after this ends ``TIMEOUT`` (unless it opts in to
    redispatch). >= ``dispatch_timeout``."""
    running_timeout: float = 600.0
    """A ``RUNNING`` job with no heartbeat for this long ends ``TIMEOUT``.
    >= 3 x ``heartbeat_interval`` + ``max_skew``."""
    heartbeat_interval: float = 30.0
    """How often a running gated task touches its job. > 0."""
    reconcile_interval: float = 30.0
    """How often the reconciler runs (once per interval across all nodes). > 0."""
    reconcile_on: ReconcileOn = "beat"
    """Where the reconciler runs: in a beat node's own thread, or as a worker task."""
    lease_ttl: float = 60.0
    """Lifetime of the reconciler's lease; renewed while a pass runs. > ``store_timeout``."""
    store_timeout: float = 5.0
    """Socket timeout of the Redis store's operations. > 0."""
    min_replicas: int = 0
    """Redis only: a claim, a gate write and a ``DISPATCHED`` write count once ``WAIT``
    confirms them on this many replicas within ``store_timeout`` (else their outcome is
    unknown, read back, and nothing is published on a guess); the store must have that
    many connected at start-up (on a Redis Cluster, each master holding the namespace:
    its slot's, or every shard's). 0: no waiting. >= 0."""
    shards: int = 1
    """Redis Cluster only: how many hash slots (shards, each with its own epoch) one
    namespace spreads over, so that its claims and sweeps spread over the masters. Pinned
    in the store: every node must use the same value (another is refused at start-up), and
    changing it needs a migration. 1 keeps the one-slot layout. 1 to 256; above 1 refused
    off a Redis Cluster."""
    publish_timeout: float = 10.0
    """How long a publish may take before it counts as ambiguous. > 0."""
    retry_delay_store: float = 1.0
    """Back-off before retrying after a store error. > 0."""
    signing_key: str | tuple[str, ...] | None = None
    """HMAC key(s) that sign stored payloads (anyone who can write the store could
    otherwise make workers run tasks): one string, or a list while rotating (the
    first signs, every one verifies); each at least 16 characters. A record that
    does not verify is never published."""
    key_prefix: str = "exactonce"
    """First part of every Redis key. 1-64 letters, digits, ``_``, ``.``, ``-``."""
    table_prefix: str = "exactonce_"
    """Prefix of every SQL table. 1-32 letters, digits, ``_``, not starting with a digit."""
    node_id: str | None = None
    """This node's name in job histories; defaults to ``hostname:pid``. 1-255
    characters, no control character."""
    metrics_port: int | None = None
    """The port beat serves Prometheus ``/metrics`` on (the ``prometheus`` extra); unset: none.
    1-65535."""
    worker_metrics_port: int | None = None
    """The port a worker's main process serves Prometheus ``/metrics`` on (a prefork pool
    needs ``PROMETHEUS_MULTIPROC_DIR``); unset: none. 1-65535."""
    metrics_addr: str = DEFAULT_METRICS_ADDR
    """The address those endpoints listen on: ``"0.0.0.0"`` (the default; ``""`` means the
    same), every IPv4 interface; ``"::"`` every interface, IPv6 too where the host has it;
    or one address of the host (``"127.0.0.1"``)."""
    overdue_periods: int = 2
    """Beat's ``exactonce_entry_overdue`` gauge turns on for an entry none of whose last
    this many slots succeeded, each given a whole period to. >= 1."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if field.name != "signing_key":
                _check_type(field.name, getattr(self, field.name), field.type)
        validate_namespace(self.namespace, "exactonce_namespace")
        if not self.metrics_addr:  # prometheus-client cannot bind "": every interface
            object.__setattr__(self, "metrics_addr", DEFAULT_METRICS_ADDR)
        _check_store_url(self.store_url)
        _check_choice("catchup", self.catchup, ("latest", "all", "none"))
        _check_choice("reconcile_on", self.reconcile_on, ("beat", "worker"))
        _check_choice("terminal_history", self.terminal_history, jobs.TERMINAL_HISTORY)
        for name in (
            "tick_interval",
            "window_lookback",
            "retention",
            "replay_age",
            "dispatch_timeout",
            "dispatch_deadline",
            "running_timeout",
            "heartbeat_interval",
            "reconcile_interval",
            "lease_ttl",
            "store_timeout",
            "publish_timeout",
            "retry_delay_store",
            "catchup_limit",
        ):
            if not getattr(self, name) > 0:
                raise _error(name, f"must be > 0, got {getattr(self, name)!r}")
        if self.max_skew < 0:
            raise _error("max_skew", f"must be >= 0, got {self.max_skew!r}")
        if self.overdue_periods < 1:
            raise _error("overdue_periods", f"must be >= 1, got {self.overdue_periods!r}")
        if self.min_replicas < 0:
            raise _error("min_replicas", f"must be >= 0, got {self.min_replicas!r}")
        if not 1 <= self.shards <= MAX_SHARDS:
            raise _error("shards", f"must be 1 to {MAX_SHARDS}, got {self.shards!r}")
        if self.max_lateness is not None and self.max_lateness <= 0:
            raise _error("max_lateness", f"must be > 0 or None, got {self.max_lateness!r}")
        if not _PREFIX_RE.match(self.key_prefix):
            raise _error("key_prefix", "must be 1-64 letters, digits, '_', '.' or '-'")
        if not _TABLE_PREFIX_RE.match(self.table_prefix):
            raise _error(
                "table_prefix", "must be 1-32 letters, digits or '_', not starting with a digit"
            )
        if self.signing_key is not None:
            keys = signing.normalize_keys(self.signing_key, PREFIX + "signing_key")
            if not isinstance(self.signing_key, str):
                object.__setattr__(self, "signing_key", keys)  # a list, frozen
        if self.node_id is not None:
            try:  # the rules every store applies to the node id of each write
                refs.validate_identifier(self.node_id, "node id", refs.MAX_NAME_LENGTH)
            except exceptions.InvalidPayload as exc:
                raise _error(
                    "node_id",
                    f"must be 1-{refs.MAX_NAME_LENGTH} characters, none of them a control "
                    f"character ({exc})",
                ) from None
        for name in ("metrics_port", "worker_metrics_port"):
            port = getattr(self, name)
            if port is not None and not 1 <= port <= 65535:
                raise _error(name, f"must be a TCP port (1-65535) or None, got {port!r}")
        self._check_consistency()

    def _check_consistency(self) -> None:
        horizon = self.window_lookback + self.tick_interval + self.max_skew
        if self.retention < horizon:
            raise _error(
                "retention",
                f"({self.retention:g} s) must be >= window_lookback + tick_interval + max_skew "
                f"({horizon:g} s): a record must outlive every node's look-back",
            )
        kept = self.occurrence_retention
        if kept is not None and not horizon <= kept <= self.retention:
            raise _error(
                "occurrence_retention",
                f"({kept:g} s) must be >= window_lookback + tick_interval + max_skew "
                f"({horizon:g} s) and <= retention ({self.retention:g} s)",
            )
        floor = 2 * (self.tick_interval + self.publish_timeout + self.store_timeout)
        if self.replay_age < floor:
            raise _error(
                "replay_age",
                f"({self.replay_age:g} s) must be >= 2 x (tick_interval + publish_timeout + "
                f"store_timeout) = {floor:g} s, or live dispatches would be replayed",
            )
        if self.dispatch_timeout <= self.replay_age:
            raise _error(
                "dispatch_timeout",
                f"({self.dispatch_timeout:g} s) must be > replay_age ({self.replay_age:g} s)",
            )
        if self.dispatch_deadline < self.dispatch_timeout:
            raise _error(
                "dispatch_deadline",
                f"({self.dispatch_deadline:g} s) must be >= dispatch_timeout "
                f"({self.dispatch_timeout:g} s)",
            )
        floor = 3 * self.heartbeat_interval + self.max_skew
        if self.running_timeout < floor:
            raise _error(
                "running_timeout",
                f"({self.running_timeout:g} s) must be >= 3 x heartbeat_interval + max_skew "
                f"({floor:g} s), or live jobs would time out between heartbeats",
            )
        if self.lease_ttl <= self.store_timeout:
            raise _error(
                "lease_ttl",
                f"({self.lease_ttl:g} s) must be > store_timeout ({self.store_timeout:g} s)",
            )

    @property
    def compaction(self) -> jobs.Compaction:
        """What a terminal record keeps, and how long an occurrence's is kept."""
        return jobs.Compaction(
            self.terminal_history, self.terminal_payload, self.occurrence_retention
        )

    @classmethod
    def from_mapping(cls, settings: Mapping[str, Any]) -> ExactOnceConfig:
        """Build from ``exactonce_*`` keys; unknown ones warn (:class:`UnknownSettingWarning`)
        at the caller, naming the known setting each resembles."""
        for unknown in unknown_settings.find(settings, KNOWN, PREFIX):
            warnings.warn(unknown.message, UnknownSettingWarning, stacklevel=2)
        return cls._from_known(settings)

    @classmethod
    def _from_known(cls, settings: Mapping[str, Any]) -> ExactOnceConfig:
        values: dict[str, Any] = {}
        for raw_key, value in settings.items():
            name = raw_key.lower()[len(PREFIX) :]
            if name in KNOWN:
                values[name] = value
        if values.get("store_url") is None:
            raise _error("store_url", "is required (e.g. redis://localhost:6379/0)")
        return cls(**values)

    @classmethod
    def from_app(cls, app: Any) -> ExactOnceConfig:
        """Read and validate the settings of Celery app ``app``.

        An unknown ``exactonce_*`` setting warns (:class:`UnknownSettingWarning`)
        at the file the app's settings come from, with the setting meant.

        Raises
        ------
        ConfigurationError
            A setting is missing, of the wrong type or inconsistent; the message
            names it as the app spells it (``exactonce_retention``).
        """
        unknown_settings.warn(app, unknown_of(app))
        return cls._from_known(settings_of(app))

    def __repr__(self) -> str:
        # The dataclass repr would print store_url and signing_key in clear, and a
        # config ends up in logs, tracebacks (locals) and debugger output.
        fields = ", ".join(f"{name}={value!r}" for name, value in self.redacted().items())
        return f"{type(self).__name__}({fields})"

    def redacted(self) -> dict[str, Any]:
        """The settings as a dict for logs and ``exactonce check``: no secret in clear."""
        data = dataclasses.asdict(self)
        data["store_url"] = redact_url(self.store_url)
        if self.signing_key is not None:
            data["signing_key"] = "***"
        return data


def settings_of(app: Any) -> dict[str, Any]:
    """The ``exactonce_*`` settings of ``app``, keys lower-case (Django's ``CELERY_`` stripped)."""
    return {name: app.conf.get(key) for name, key in _keys_of(app).items()}


def unknown_of(app: Any) -> list[unknown_settings.Unknown]:
    """The ``exactonce_*`` settings of ``app`` this version does not know, as spelled."""
    return unknown_settings.find(_keys_of(app).values(), KNOWN, PREFIX)


def _keys_of(app: Any) -> dict[str, str]:
    """Each ``exactonce_*`` setting of ``app``: its lower-case name, and its key as spelled."""
    conf = app.conf
    namespace = (getattr(app, "namespace", None) or "").lower()
    strip = f"{namespace}_" if namespace else ""
    keys: dict[str, str] = {}
    for key in list(conf.keys()):
        lowered = str(key).lower()
        if strip and lowered.startswith(strip + PREFIX):
            lowered = lowered[len(strip) :]
        if lowered.startswith(PREFIX):
            keys[lowered] = str(key)
    return keys


def _error(name: str, problem: str) -> exceptions.ConfigurationError:
    return exceptions.ConfigurationError(f"{PREFIX}{name} {problem}", setting=PREFIX + name)


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise _error(name, f"must be one of {', '.join(map(repr, choices))}, got {value!r}")


def _check_type(name: str, value: object, annotation: object) -> None:
    text = str(annotation)
    optional = "None" in text
    if value is None:
        if not optional:
            raise _error(name, "must be set, got None")
        return
    if text == "bool":
        if not isinstance(value, bool):
            raise _error(name, f"must be True or False, got {type(value).__name__} {value!r}")
    elif text.startswith(("float", "int")):
        number_ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if text.startswith("int") and not isinstance(value, int):
            number_ok = False
        if not number_ok or (isinstance(value, float) and not math.isfinite(value)):
            kind = "an integer" if text.startswith("int") else "a finite number of seconds"
            raise _error(name, f"must be {kind}, got {type(value).__name__} {value!r}")
    elif not isinstance(value, str):
        raise _error(name, f"must be a string, got {type(value).__name__} {value!r}")


def _check_store_url(url: str) -> None:
    scheme = url.split("://", 1)[0].lower().split("+", 1)[0] if "://" in url else ""
    if scheme not in KNOWN_SCHEMES:
        raise not_a_store_url(url, "is not a store URL")


#: Every setting's name without the prefix.
KNOWN = frozenset(field.name for field in dataclasses.fields(ExactOnceConfig))


def as_catchup(value: str) -> Catchup:
    """``value`` checked as a catch-up policy (for per-entry overrides)."""
    _check_choice("catchup", value, ("latest", "all", "none"))
    return cast(Catchup, value)
