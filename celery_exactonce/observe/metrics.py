"""Counters, structured log events and Sentry reports: how every skip is made visible.

Every event the package wants an operator to see goes through :func:`event`:
one log record whose ``extra`` carries a stable ``action`` key (grep and alert
on it), one increment of a counter of the same name (with labels such as the
phase of a fail-closed event), and, for the events that need a human, a Sentry
event when, and only when, the host application initialised Sentry. It is the
one path: every record with an ``action`` is counted, and every counter has
its records. An event that is also an instance of a broader one (a publish
rolled back is a ``fail_closed`` of phase ``publish``) names it in ``also``:
one record, both counters.

Counters are per process (:data:`COUNTERS`); when ``prometheus-client`` is
installed they are mirrored into a Prometheus counter
``exactonce_events_total{action=…, …}``, and the end of each reconcile pass
this process runs into the gauge
``exactonce_reconcile_last_pass_timestamp_seconds``. Beat's other gauges and
its ``/metrics`` endpoint are :mod:`celery_exactonce.observe.prometheus`'s.

A Sentry event is tagged ``exactonce.action`` and ``exactonce.<name>`` for each
label and field (``task``, ``key``: the beat entry, ``state``, ``job_id``...).
The actions of :data:`SENTRY_BURSTS` come in bursts (a store outage fails
closed every tick and every job): at most one Sentry event per action and
labels every so many seconds, each telling how many were held back before it
(``exactonce.held_back``). Every one is logged and counted all the same.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

logger = logging.getLogger("celery_exactonce")

#: Label names that may appear on counters: a closed set keeps the metric's
#: cardinality bounded (task and entry names, never a job id: that is a log field).
LABELS = ("phase", "where", "state", "task", "entry")

#: Fields an event's counter takes as a label when its ``labels`` do not set it:
#: field name -> label name (an occurrence's ``key`` is its beat entry).
FIELD_LABELS = (("task", "task"), ("key", "entry"))

#: Label sets whose counter key a process remembers (:class:`Counters`); past this many,
#: a key is worked out at each increment.
KEYS_KEPT = 10_000


class Counters:
    """Thread-safe event counters keyed by ``(action, labels)``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()
        #: ``(action, *labels.items())`` -> its counter's key, for labels of text values
        #: (their number is bounded as the counters' is): a hot path's event, say every
        #: submit's, sorts and filters its labels once per process, not once per call.
        self._keys: dict[tuple[Any, ...], tuple[str, tuple[tuple[str, str], ...]]] = {}

    def incr(self, action: str, labels: Mapping[str, str] | None = None, amount: int = 1) -> None:
        """Add ``amount`` to ``action`` under ``labels`` (only names in :data:`LABELS` count,
        and an empty value is no label)."""
        key = self._key(action, labels) if labels else (action, ())
        with self._lock:
            self._counts[key] += amount
        _prometheus_incr(key, amount)

    def _key(
        self, action: str, labels: Mapping[str, str]
    ) -> tuple[str, tuple[tuple[str, str], ...]]:
        asked = (action, *labels.items())
        try:
            return self._keys[asked]
        except (KeyError, TypeError):  # not yet, or a value that does not hash
            pass
        pairs = tuple(sorted((k, str(v)) for k, v in labels.items() if k in LABELS and v))
        key = (action, pairs)
        if all(isinstance(v, str) for v in labels.values()) and len(self._keys) < KEYS_KEPT:
            self._keys[asked] = key
        return key

    def get(self, action: str, **labels: str) -> int:
        """The count of ``action``, summed over every label set that includes ``labels``."""
        wanted = {(k, str(v)) for k, v in labels.items()}
        with self._lock:
            return sum(
                n for (a, lbl), n in self._counts.items() if a == action and wanted <= set(lbl)
            )

    def snapshot(self) -> dict[str, int]:
        """``{"action{label=value,…}": count}`` for reports and tests."""
        with self._lock:
            items = list(self._counts.items())
        return {
            action + ("{" + ",".join(f"{k}={v}" for k, v in labels) + "}" if labels else ""): n
            for (action, labels), n in sorted(items)
        }

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()


COUNTERS = Counters()

#: Actions sent to Sentry once per burst: at most one event per this many seconds
#: for each set of labels (a fail-closed phase, a skip reason), in each process.
SENTRY_BURSTS: dict[str, float] = {"fail_closed": 60.0, "slot_skipped": 60.0}


class Bursts:
    """Which reports of a bursty action go to Sentry (:data:`SENTRY_BURSTS`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: The seconds bursts are measured in (a test may step its own).
        self.clock: Callable[[], float] = time.monotonic
        #: ``(action, labels)`` -> the clock's time of the last report sent, reports held since.
        self._last: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[float, int]] = {}

    def admit(self, action: str, labels: Mapping[str, str] | None, window: float) -> int | None:
        """``None``: hold this report back; else send it, and this many were held before it."""
        key = (action, tuple(sorted((k, str(v)) for k, v in (labels or {}).items())))
        now = self.clock()
        with self._lock:
            sent_at, held = self._last.get(key, (None, 0))
            if sent_at is not None and now - sent_at < window:
                self._last[key] = (sent_at, held + 1)
                return None
            self._last[key] = (now, 0)
            return held

    def reset(self) -> None:
        with self._lock:
            self._last.clear()


BURSTS = Bursts()


def event(
    action: str,
    message: str,
    *args: Any,
    level: int = logging.INFO,
    labels: Mapping[str, str] | None = None,
    sentry: bool = False,
    exc_info: BaseException | None = None,
    count: int = 1,
    also: tuple[str, ...] = (),
    **fields: Any,
) -> None:
    """Count ``action`` (``count`` times), log ``message`` once with ``extra={"action": …}``.

    ``args`` are ``message``'s ``%`` arguments, formatted only if the record is
    written (a hot path's debug event costs no formatting). ``also`` names
    broader events this one counts as too (same labels; the
    record lists them under ``also``). With ``sentry=True`` the event also goes
    to Sentry, tagged with the action, the labels and the fields, if the host
    app initialised Sentry (once per burst for :data:`SENTRY_BURSTS`).
    """
    counted = _counted_labels(labels, fields)
    COUNTERS.incr(action, counted, count)
    for broader in also:
        COUNTERS.incr(broader, counted, count)
    if logger.isEnabledFor(level):
        extra = {"action": action, **dict(labels or {}), **fields}
        if count != 1:
            extra["count"] = count
        if also:
            extra["also"] = list(also)
        logger.log(level, message, *args, extra=extra, exc_info=exc_info)
    if sentry:
        tags = {**dict(labels or {}), **fields}
        window = SENTRY_BURSTS.get(action)
        if window is not None:
            held = BURSTS.admit(action, labels, window)
            if held is None:
                return
            if held:
                tags["held_back"] = held
        text = message % args if args else message
        report_to_sentry(action, text, tags, exc_info, level=level)


def _counted_labels(
    labels: Mapping[str, str] | None, fields: Mapping[str, Any]
) -> Mapping[str, str] | None:
    """``labels``, with the :data:`FIELD_LABELS` the event's fields give and ``labels`` leave unset.

    An event names its job's task (``task``) and an occurrence's entry (``key``)
    as fields; its counter carries them as labels. An event whose ``task`` or
    ``key`` field stands for more than what it counts (the first of several
    entries) sets the label itself, empty.
    """
    promoted = None
    for field, label in FIELD_LABELS:
        value = fields.get(field)
        if value and (labels is None or label not in labels):
            if promoted is None:
                promoted = dict(labels or {})
            promoted[label] = str(value)
    return labels if promoted is None else promoted


def report_to_sentry(
    action: str,
    message: str,
    tags: Mapping[str, Any],
    exc: BaseException | None = None,
    *,
    level: int = logging.ERROR,
) -> bool:
    """Send an event to Sentry if the host app initialised it; return whether it was sent.

    An app that initialised Sentry imported ``sentry_sdk``: this never imports
    it. ``level`` is the record's: an error, or else a warning in Sentry.
    """
    sentry_sdk = sys.modules.get("sentry_sdk")
    if sentry_sdk is None:
        return False
    client = sentry_sdk.get_client()
    if not client.is_active() or getattr(client, "transport", None) is None:  # no DSN
        return False
    with sentry_sdk.new_scope() as scope:
        scope.set_tag("exactonce.action", action)
        for key, value in tags.items():
            if value is not None:
                scope.set_tag(f"exactonce.{key}", str(value))
        if exc is not None:
            sentry_sdk.capture_exception(exc)
        else:
            sentry_sdk.capture_message(
                message, level="error" if level >= logging.ERROR else "warning"
            )
    return True


#: Wall time (``time.time()``) the last reconcile pass this process ran ended.
_last_pass: float | None = None


def reconcile_pass_finished() -> None:
    """A reconcile pass this process ran ended: remember when (and set the gauge)."""
    global _last_pass  # noqa: PLW0603  (one value per process)
    _last_pass = time.time()
    ensure_prometheus()
    if _prometheus_last_pass is not None:
        _prometheus_last_pass.set(_last_pass)


def last_reconcile_pass() -> float | None:
    """Wall time the last reconcile pass this process ran ended; ``None``: none yet."""
    return _last_pass


_prometheus_lock = threading.Lock()
_prometheus_counter: Any = None
_prometheus_last_pass: Any = None
_prometheus_checked = False
#: The counter's child per label values, remembered (label values are bounded).
_prometheus_children: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}


def ensure_prometheus() -> None:
    """Make this process's Prometheus metrics once, if ``prometheus-client`` is installed.

    They live in its default registry, so a ``/metrics`` endpoint of the host
    (or beat's, ``exactonce_metrics_port``) shows them; under
    ``PROMETHEUS_MULTIPROC_DIR`` each process writes its own file, summed
    (the counter) or maxed (the last pass) by the one that serves them.
    """
    global _prometheus_counter, _prometheus_last_pass, _prometheus_checked  # noqa: PLW0603
    if _prometheus_checked:
        return
    with _prometheus_lock:
        if _prometheus_checked:
            return
        try:
            import prometheus_client

            _prometheus_counter = prometheus_client.Counter(
                "exactonce_events",
                "celery-exactonce events by action",
                ["action", *LABELS],
            )
            _prometheus_last_pass = prometheus_client.Gauge(
                "exactonce_reconcile_last_pass_timestamp_seconds",
                "When the last reconcile pass this process ran ended (UNIX time)",
                multiprocess_mode="max",
            )
        except (ImportError, ValueError):
            _prometheus_counter = _prometheus_last_pass = None
        except OSError as exc:  # multiprocess mode's directory cannot be written
            _prometheus_off(exc)
        _prometheus_checked = True


def _prometheus_off(exc: OSError) -> None:
    """Stop mirroring into Prometheus, saying why once: an export that cannot be written
    must not stop the process (the counters in :data:`COUNTERS` go on)."""
    global _prometheus_counter, _prometheus_last_pass  # noqa: PLW0603
    _prometheus_counter = _prometheus_last_pass = None
    logger.warning(
        "prometheus-client cannot write its values (%s): this process's events are not "
        "exported; PROMETHEUS_MULTIPROC_DIR must name an existing directory, and only a "
        "prefork worker's processes need it",
        exc,
    )


def _prometheus_incr(key: tuple[str, tuple[tuple[str, str], ...]], amount: int) -> None:
    """Add ``amount`` to the Prometheus child of ``key`` (an action, its sorted label pairs)."""
    ensure_prometheus()
    if _prometheus_counter is not None:
        child = _prometheus_children.get(key)
        try:
            if child is None:  # prometheus_client's labels() looks the child up under a lock
                labels = dict(key[1])
                child = _prometheus_counter.labels(key[0], *(labels.get(n, "") for n in LABELS))
                _prometheus_children[key] = child
            child.inc(amount)
        except OSError as exc:
            _prometheus_off(exc)
