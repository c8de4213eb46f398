"""A metrics endpoint whose ``/healthz`` and ``/readyz`` answer as told, for the probes' tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry

from celery_exactonce.observe.health import Verdict
from celery_exactonce.observe.prometheus import MetricsServer
from tests.integration.servers import free_port


class Fixed:
    """Probes that answer ``live`` and ``ready`` whatever happens."""

    def __init__(self, live: Verdict, ready: Verdict) -> None:
        self._live, self._ready = live, ready

    def live(self) -> Verdict:
        return self._live

    def ready(self) -> Verdict:
        return self._ready


@contextmanager
def served(live: Verdict, ready: Verdict) -> Iterator[int]:
    """An endpoint on 127.0.0.1 answering ``live`` and ``ready``; its port."""
    probes = Fixed(live, ready)
    server = MetricsServer(
        free_port(), "127.0.0.1", CollectorRegistry(), setting="x", probes=probes
    )
    try:
        yield server.port
    finally:
        server.close()
