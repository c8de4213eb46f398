"""Scraping a real process's Prometheus ``/metrics`` in acceptance tests."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from tests.acceptance.harness import poll

Sample = tuple[str, tuple[tuple[str, str], ...]]

#: Seconds a scrape may take to show what the test waits for (store counts are
#: read at most every 5 s; a beat or worker needs a few seconds to start).
DEADLINE = 60.0


def free_port() -> int:
    """A TCP port nothing listens on now (the OS's pick)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(port: int) -> dict[Sample, float] | None:
    """The samples of ``/metrics`` on ``port``; ``None`` while nothing listens there yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return None
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def count(samples: dict[Sample, float], action: str, **labels: str) -> float:
    """``exactonce_events_total`` of ``action``, summed over every series with ``labels``
    (whatever its other labels: the task, the entry...)."""
    wanted = {("action", action), *labels.items()}
    return sum(
        value
        for (name, found), value in samples.items()
        if name == "exactonce_events_total" and wanted <= set(found)
    )


def jobs(state: str) -> Sample:
    """The sample of the ``exactonce_jobs`` gauge for ``state``."""
    return ("exactonce_jobs", (("state", state),))


def total(samples: dict[Sample, float], name: str) -> float:
    """The sum of every sample of metric ``name``, whatever its labels."""
    return sum(value for (sample, _), value in samples.items() if sample == name)


def scrape_until(port: int, check: Callable[[dict[Sample, float]], bool]) -> dict[Sample, float]:
    """Scrape ``port`` until ``check(samples)`` holds (poll with :data:`DEADLINE`)."""

    def attempt() -> dict[Sample, float] | None:
        samples = scrape(port)
        return samples if samples is not None and check(samples) else None

    return poll(attempt, timeout=DEADLINE, interval=0.5)
