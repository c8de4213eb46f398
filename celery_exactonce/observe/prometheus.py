"""Prometheus: beat's ``/metrics`` (``exactonce_metrics_port``) and a worker's.

Imported only when one of those settings is set (it imports
``prometheus-client``, the ``prometheus`` extra). What each endpoint serves:

* every process: the event counter ``exactonce_events_total{action=…}`` and
  ``exactonce_reconcile_last_pass_timestamp_seconds``
  (:mod:`celery_exactonce.observe.metrics`), with whatever else the process's default
  registry holds;
* beat, on each scrape (:class:`BeatCollector`): the records per state
  (``exactonce_jobs{state=…}``), the due backlog (``exactonce_due_jobs``) and
  the age of its oldest job (``exactonce_oldest_due_job_age_seconds``), read
  from the store at most every :data:`~celery_exactonce.observe.gauges.MAX_AGE`
  seconds by a thread of their own, with ``exactonce_store_up`` (0 when that
  read failed or is stale: the store gauges are then left out); when this
  node's tick last ended (``exactonce_beat_last_tick_timestamp_seconds{node=…}``);
  and with ``exactonce_reconcile_on = "beat"``, the seconds since this node
  last finished a reconcile pass (``exactonce_reconcile_lag_seconds``);
* a worker (``exactonce_worker_metrics_port``), from its main process: under
  ``PROMETHEUS_MULTIPROC_DIR`` what every process of the worker wrote there
  (prometheus-client's multiprocess mode: counters summed across the pool's
  children, the last pass the latest of them), which a prefork pool needs.

Not here: the values themselves (:mod:`celery_exactonce.observe.gauges`,
:mod:`celery_exactonce.observe.metrics`), when the endpoints start
(:mod:`celery_exactonce.startup`).
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from typing import Any
from wsgiref import simple_server

import prometheus_client
from prometheus_client import multiprocess, values
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry

from celery_exactonce.config import DEFAULT_METRICS_ADDR
from celery_exactonce.core import exceptions
from celery_exactonce.core.states import State
from celery_exactonce.observe import metrics
from celery_exactonce.observe.entry_health import EntryHealth, EntryHealthReader
from celery_exactonce.observe.gauges import MAX_AGE, BeatGauges, StoreGauges
from celery_exactonce.observe.health import Probes, with_probes

#: A snapshot of the store older than this many ``MAX_AGE`` counts as stale (store down).
STALE_AFTER = 3

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class BeatCollector(Collector):
    """Beat's gauges, computed on each scrape (the store's read at most every ``MAX_AGE``)."""

    def __init__(
        self, beat: BeatGauges, store: StoreGauges, *, reconcile_here: bool = True
    ) -> None:
        self.beat = beat
        self.store = store
        self.reconcile_here = reconcile_here

    def describe(self) -> Iterable[Metric]:
        """The families without values: registering it reads nothing."""
        return list(self._families(with_values=False))

    def collect(self) -> Iterable[Metric]:
        return list(self._families(with_values=True))

    def _families(self, *, with_values: bool) -> Iterable[Metric]:
        tick = GaugeMetricFamily(
            "exactonce_beat_last_tick_timestamp_seconds",
            "When this beat node's last tick ended (UNIX time)",
            labels=["node"],
        )
        if with_values and self.beat.last_tick is not None:
            tick.add_metric([self.beat.node], self.beat.last_tick)
        yield tick
        if self.reconcile_here:
            lag = GaugeMetricFamily(
                "exactonce_reconcile_lag_seconds",
                "Seconds since this beat node last finished a reconcile pass (or started)",
            )
            if with_values:
                lag.add_metric([], self.beat.reconcile_lag())
            yield lag
        up = GaugeMetricFamily(
            "exactonce_store_up", "Whether the last read of the store's counts succeeded"
        )
        jobs = GaugeMetricFamily(
            "exactonce_jobs", "Job records in the store, by state", labels=["state"]
        )
        due = GaugeMetricFamily(
            "exactonce_due_jobs", "Delayed jobs whose run_at has come, not yet claimed"
        )
        oldest = GaugeMetricFamily(
            "exactonce_oldest_due_job_age_seconds",
            "Seconds the oldest due delayed job has waited past its run_at (store time)",
        )
        shown: tuple[EntryHealth, ...] = ()
        if with_values:
            snapshot = self.store.read()
            fresh = snapshot is not None and (
                time.monotonic() - snapshot.taken < STALE_AFTER * self.store.max_age
            )
            ok = snapshot is not None and fresh and snapshot.error is None
            up.add_metric([], 1.0 if ok else 0.0)
            if ok and snapshot is not None and snapshot.counts and snapshot.backlog:
                for state in State:
                    jobs.add_metric([state.value], snapshot.counts.get(state, 0))
                due.add_metric([], snapshot.backlog.count)
                oldest.add_metric([], snapshot.backlog.oldest_age)
            if ok and snapshot is not None:
                shown = snapshot.entries
        yield from (up, jobs, due, oldest)
        if self.store.health is not None:
            yield from entry_families(shown)


#: Beat's per-entry gauges: name, help, the value of an :class:`EntryHealth` (``None``: none).
ENTRY_GAUGES: tuple[tuple[str, str, Callable[[EntryHealth], float | None]], ...] = (
    (
        "exactonce_entry_last_claimed_timestamp_seconds",
        "The newest slot of the entry any beat node claimed (fire time, UNIX time)",
        lambda h: _stamp(h.last_claimed),
    ),
    (
        "exactonce_entry_last_success_timestamp_seconds",
        "The newest slot of the entry seen succeed: SUCCEEDED, or PUBLISHED for an ungated "
        "task (fire time, UNIX time)",
        lambda h: _stamp(h.last_success),
    ),
    (
        "exactonce_entry_next_slot_timestamp_seconds",
        "The entry's next slot (fire time, UNIX time)",
        lambda h: _stamp(h.next_slot),
    ),
    (
        "exactonce_entry_period_seconds",
        "Seconds between the entry's next two slots",
        lambda h: h.period,
    ),
    (
        "exactonce_entry_overdue",
        "1 when none of the entry's last exactonce_overdue_periods slots succeeded",
        lambda h: 1.0 if h.overdue else 0.0,
    ),
)


def _stamp(value: datetime | None) -> float | None:
    return None if value is None else value.timestamp()


def entry_families(found: Iterable[EntryHealth]) -> Iterator[Metric]:
    """:data:`ENTRY_GAUGES`, labelled ``entry`` and ``task``, for each entry of ``found``."""
    found = list(found)
    for name, text, value_of in ENTRY_GAUGES:
        family = GaugeMetricFamily(name, text, labels=["entry", "task"])
        for health in found:
            value = value_of(health)
            if value is not None:
                family.add_metric([health.entry, health.task], value)
        yield family


class _Joined(Collector):
    """The samples of several collectors as one (a registry of this process, and beat's)."""

    def __init__(self, *parts: Collector) -> None:
        self.parts = parts

    def collect(self) -> Iterable[Metric]:
        for part in self.parts:
            yield from part.collect()


class MetricsServer:
    """A ``/metrics`` HTTP endpoint in a thread of this process; :meth:`close` stops it.

    It serves ``registry`` and, for beat, its :class:`BeatCollector`, which is
    registered nowhere (two schedulers of one process, each with its port,
    never clash); with ``probes``, ``/healthz`` and ``/readyz`` too
    (:mod:`~celery_exactonce.observe.health`).
    """

    def __init__(
        self,
        port: int,
        addr: str,
        registry: Collector,
        *,
        setting: str,
        collector: BeatCollector | None = None,
        probes: Probes | None = None,
    ) -> None:
        self.collector = collector
        self.probes = probes
        addr = addr or DEFAULT_METRICS_ADDR  # prometheus-client cannot bind ""
        metrics.ensure_prometheus()  # the event families exist before the first event
        served = registry if collector is None else _Joined(registry, collector)
        app = with_probes(prometheus_client.make_wsgi_app(served), probes)
        try:
            self._server = _server(addr, port, app)
        except OSError as exc:
            raise refusal(setting, port, addr, exc) from exc
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="exactonce-metrics", daemon=True
        )
        self._thread.start()
        self.port = int(self._server.server_address[1])
        self._closed = threading.Event()

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)
        if self.collector is not None:
            self.collector.store.close()
        close = getattr(self.probes, "close", None)
        if close is not None:
            close()


class _Quiet(simple_server.WSGIRequestHandler):
    """A request handler that logs nothing (a probe every few seconds is no news)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _server(addr: str, port: int, app: Any) -> simple_server.WSGIServer:
    """An HTTP server of ``app`` on ``addr:port`` (a thread per request), not serving yet."""
    family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]

    class Server(ThreadingWSGIServer):
        address_family = family

    return simple_server.make_server(addr, port, app, Server, handler_class=_Quiet)


def refusal(setting: str, port: int, addr: str, exc: OSError) -> exceptions.ConfigurationError:
    """Why ``/metrics`` cannot be served on ``addr:port``, and what to change."""
    if exc.errno in (errno.EADDRINUSE, errno.EACCES):
        fix = f"set {setting} to a free port (or stop what listens there)"
    else:
        fix = (
            "set exactonce_metrics_addr to an address of this host "
            '("0.0.0.0": every IPv4 interface, "::": IPv6 too, "127.0.0.1": this host only)'
        )
    return exceptions.ConfigurationError(
        f"{setting}={port}: cannot serve /metrics on {addr}:{port}: {exc}: {fix}",
        setting=setting,
    )


def probe(port: int, addr: str, *, setting: str) -> str:
    """Bind ``addr:port`` as the endpoint would, and release it at once.

    Returns where the endpoint would listen; raises a ``ConfigurationError``
    naming ``setting`` and the fix when it cannot (an address this host does
    not have, a port taken). It proves the port free now, not when the node
    starts.
    """
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(
            addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server does
            sock.bind(sockaddr)
    except OSError as exc:  # socket.gaierror is one
        raise refusal(setting, port, addr, exc) from exc
    return f"{addr}:{port}"


def serve_beat(
    store: Any,
    beat: BeatGauges,
    *,
    port: int,
    addr: str = DEFAULT_METRICS_ADDR,
    reconcile_here: bool = True,
    max_age: float = MAX_AGE,
    health: EntryHealthReader | None = None,
    probes: Probes | None = None,
) -> MetricsServer:
    """Serve beat's ``/metrics``: the default registry and a :class:`BeatCollector`
    (each entry's health too, with ``health``); ``/healthz`` and ``/readyz`` with ``probes``.

    Refused under ``PROMETHEUS_MULTIPROC_DIR``: beat serves its own registry, and in that
    mode its counters would go to files no one merges.
    """
    if os.environ.get(MULTIPROC_ENV):
        raise exceptions.ConfigurationError(
            f"exactonce_metrics_port: {MULTIPROC_ENV} is set in beat's environment, where "
            "beat's counters would go to files no one reads: set it for prefork workers only",
            setting="exactonce_metrics_port",
        )
    gauges = StoreGauges(store, max_age=max_age, health=health)
    collector = BeatCollector(beat, gauges, reconcile_here=reconcile_here)
    return MetricsServer(
        port, addr, REGISTRY, setting="exactonce_metrics_port", collector=collector, probes=probes
    )


def serve_worker(
    *, port: int, addr: str = DEFAULT_METRICS_ADDR, prefork: bool, probes: Probes | None = None
) -> MetricsServer:
    """Serve a worker's ``/metrics`` from its main process (``/healthz``, ``/readyz``: ``probes``).

    Under ``PROMETHEUS_MULTIPROC_DIR``: every process's files, merged; without
    it, this process's registry, which a prefork pool cannot use (its
    children's counts would be missing): refused.
    """
    setting = "exactonce_worker_metrics_port"
    directory = os.environ.get(MULTIPROC_ENV)
    if not directory:
        if prefork:
            raise exceptions.ConfigurationError(
                f"{setting} with the prefork pool needs {MULTIPROC_ENV} (an empty directory, "
                "in the worker's environment before it starts): the pool's processes count "
                "their own events, merged from there",
                setting=setting,
            )
        return MetricsServer(port, addr, REGISTRY, setting=setting, probes=probes)
    if not os.path.isdir(directory):
        raise exceptions.ConfigurationError(
            f"{setting}: {MULTIPROC_ENV}={directory!r} is not a directory",
            setting=setting,
        )
    if not getattr(values.ValueClass, "_multiprocess", False):
        raise exceptions.ConfigurationError(
            f"{setting}: {MULTIPROC_ENV} was set after prometheus_client was imported; "
            "set it in the worker's environment before the worker starts",
            setting=setting,
        )
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
    return MetricsServer(port, addr, registry, setting=setting, probes=probes)
