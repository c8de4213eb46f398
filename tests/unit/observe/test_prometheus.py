"""Prometheus: beat's gauges and /metrics endpoint, the worker endpoint's refusals, no extra."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from celery_exactonce import ConfigurationError, StoreUnavailable, startup
from celery_exactonce.config import ExactOnceConfig
from celery_exactonce.core.states import State
from celery_exactonce.observe import metrics, prometheus
from celery_exactonce.observe.gauges import BeatGauges, StoreGauges
from celery_exactonce.startup import StartupRefused
from celery_exactonce.stores import InMemoryStore
from tests.support.beat_cluster import Cluster, every, isolated, refused_at_start
from tests.support.helpers import poll, task_job

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _isolated() -> Iterator[None]:
    with isolated():
        yield


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``{(name, labels): value}`` of a scrape."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return samples(reply.read().decode())


def collected(collector: prometheus.BeatCollector) -> dict[str, Any]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in collector.collect()
        for s in family.samples
    }


class FlakyStore(InMemoryStore):
    """An in-memory store whose counts fail, block or count their reads on demand."""

    def __init__(self) -> None:
        super().__init__("gauges")
        self.fail = False
        self.gate = threading.Event()
        self.gate.set()
        self.reads = 0

    def count_by_state(self) -> dict[State, int]:
        self.reads += 1
        self.gate.wait(10)
        if self.fail:
            raise StoreUnavailable("the store is down")
        return super().count_by_state()


def test_beat_collector_reports_the_store_counts_and_the_backlog() -> None:
    store = FlakyStore()
    now = store.now()
    store.create(task_job("late", state=State.PENDING, run_at=now - timedelta(seconds=90)))
    store.create(task_job("later", state=State.PENDING, run_at=now + timedelta(hours=1)))
    store.create(task_job("s"))
    beat = BeatGauges("node-a")
    collector = prometheus.BeatCollector(beat, StoreGauges(store), reconcile_here=False)
    values = collected(collector)
    assert values[("exactonce_store_up", ())] == 1.0
    assert values[("exactonce_jobs", (("state", "PENDING"),))] == 2
    assert values[("exactonce_jobs", (("state", "SCHEDULED"),))] == 1
    assert values[("exactonce_jobs", (("state", "SUCCEEDED"),))] == 0
    assert values[("exactonce_due_jobs", ())] == 1
    assert 90 <= values[("exactonce_oldest_due_job_age_seconds", ())] < 120
    assert not any(name == "exactonce_beat_last_tick_timestamp_seconds" for name, _ in values)
    assert ("exactonce_reconcile_lag_seconds", ()) not in values
    with beat.ticking():
        pass
    ticked = collected(collector)
    assert ticked[("exactonce_beat_last_tick_timestamp_seconds", (("node", "node-a"),))] > 0


def test_store_counts_are_read_at_most_every_max_age() -> None:
    store = FlakyStore()
    clock = [100.0]
    gauges = StoreGauges(store, max_age=10, monotonic=lambda: clock[0])
    first = gauges.read()
    assert first is not None and gauges.read() is first and store.reads == 1
    clock[0] += 11
    assert gauges.read() is not first and store.reads == 2
    gauges.close()


def test_a_store_error_is_an_event_and_store_up_0_not_a_failed_scrape() -> None:
    store = FlakyStore()
    store.fail = True
    collector = prometheus.BeatCollector(BeatGauges("n"), StoreGauges(store))
    values = collected(collector)
    assert values[("exactonce_store_up", ())] == 0.0
    assert not any(name in ("exactonce_jobs", "exactonce_due_jobs") for name, _ in values)
    assert metrics.COUNTERS.get("metrics_store_error") == 1
    assert values[("exactonce_reconcile_lag_seconds", ())] >= 0


def test_a_slow_store_does_not_hold_the_scrape_past_its_wait() -> None:
    store = FlakyStore()
    gauges = StoreGauges(store, max_age=0.01, wait=0.2)
    assert gauges.read() is not None
    store.gate.clear()  # the next read blocks in the store
    collector = prometheus.BeatCollector(BeatGauges("n"), gauges)
    poll(lambda: not gauges._fresh())
    finished = threading.Event()
    values: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: (values.update(collected(collector)), finished.set()))
    worker.start()
    assert finished.wait(5), "the scrape waited on the blocked store"
    assert ("exactonce_store_up", ()) in values
    store.gate.set()
    worker.join(5)
    gauges.close()


def test_reconcile_lag_counts_from_the_last_pass_this_process_ran() -> None:
    wall = [1000.0]
    beat = BeatGauges("n", wall=lambda: wall[0])
    metrics.reconcile_pass_finished()
    last = metrics.last_reconcile_pass()
    assert last is not None
    wall[0] = last + 12
    assert beat.reconcile_lag() == pytest.approx(12)


def test_beat_serves_metrics_on_its_port_and_stops_with_the_scheduler() -> None:
    port = free_port()
    cluster = Cluster(
        {"tick": every(1)},
        nodes=1,
        exactonce_metrics_port=port,
        exactonce_metrics_addr="127.0.0.1",
    )
    (node,) = cluster.nodes
    try:
        cluster.run(3)
        first = scrape(port)
        assert first[("exactonce_store_up", ())] == 1.0
        tick = ("exactonce_beat_last_tick_timestamp_seconds", (("node", node._runtime.node),))
        assert first[tick] > 0
        # each dispatch counted under its task and entry (never its job id)
        dispatched = _with(action="dispatched", task="plain.t", entry="tick")
        assert first[("exactonce_events_total", dispatched)] >= 3
        assert sum(v for (name, _), v in first.items() if name == "exactonce_jobs") >= 3
        # ... and the entry's health: claimed, published (it is ungated), not overdue
        entry = (("entry", "tick"), ("task", "plain.t"))
        assert first[("exactonce_entry_last_claimed_timestamp_seconds", entry)] > 0
        assert first[("exactonce_entry_last_success_timestamp_seconds", entry)] > 0
        assert first[("exactonce_entry_period_seconds", entry)] == 1.0
        assert first[("exactonce_entry_overdue", entry)] == 0.0
    finally:
        node.close()
    with pytest.raises(urllib.error.URLError):
        scrape(port)


def test_a_taken_port_refuses_beat_naming_the_setting() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with refused_at_start("exactonce_metrics_port"):
            Cluster({}, nodes=1, exactonce_metrics_port=port, exactonce_metrics_addr="127.0.0.1")


@pytest.mark.parametrize("value", [0, 70000, "9100", 1.5, True])
def test_a_bad_metrics_port_is_refused_naming_the_setting(value: object) -> None:
    for name in ("metrics_port", "worker_metrics_port"):
        with pytest.raises(ConfigurationError, match=f"exactonce_{name}") as raised:
            settings = {"exactonce_store_url": "memory://", f"exactonce_{name}": value}
            ExactOnceConfig.from_mapping(settings)
        assert raised.value.setting == f"exactonce_{name}"


def test_a_prefork_worker_endpoint_needs_the_multiprocess_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    with pytest.raises(ConfigurationError, match="PROMETHEUS_MULTIPROC_DIR") as raised:
        prometheus.serve_worker(port=free_port(), addr="127.0.0.1", prefork=True)
    assert raised.value.setting == "exactonce_worker_metrics_port"
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "missing"))
    with pytest.raises(ConfigurationError, match="not a directory"):
        prometheus.serve_worker(port=free_port(), addr="127.0.0.1", prefork=True)
    # Set after prometheus_client was imported (as here): its values are not in the files.
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    with pytest.raises(ConfigurationError, match="before the worker starts"):
        prometheus.serve_worker(port=free_port(), addr="127.0.0.1", prefork=True)


def test_a_prefork_worker_with_a_metrics_port_and_no_directory_is_refused_at_init(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from celery import Celery

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    app = Celery("metrics-worker", set_as_current=False)
    app.conf.update(exactonce_store_url="memory://", exactonce_worker_metrics_port=free_port())
    with pytest.raises(StartupRefused) as refused:
        startup._on_worker_init(sender=SimpleNamespace(app=app, pool_cls="prefork"))
    assert isinstance(refused.value.error, ConfigurationError)
    assert refused.value.error.setting == "exactonce_worker_metrics_port"
    app.conf.exactonce_worker_metrics_port = None
    assert startup.serve_worker_metrics(SimpleNamespace(app=app, pool_cls="prefork")) is None


def test_a_solo_worker_serves_its_own_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    port = free_port()
    server = prometheus.serve_worker(port=port, addr="127.0.0.1", prefork=False)
    try:
        metrics.event("completed", "done", labels={"state": "SUCCEEDED"})
        key = ("exactonce_events_total", _with(action="completed", state="SUCCEEDED"))
        assert scrape(port)[key] >= 1
    finally:
        server.close()


def _with(**labels: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"action": "", **dict.fromkeys(metrics.LABELS, ""), **labels}.items()))


def test_nothing_imports_prometheus_client_when_it_is_not_installed() -> None:
    """The package, beat and its events work without the extra; the setting is refused."""
    script = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "prometheus_client":
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import celery_exactonce, celery_exactonce.beat.scheduler, celery_exactonce.startup
from celery_exactonce import ConfigurationError
from celery_exactonce.observe import metrics
metrics.event("completed", "done")
metrics.reconcile_pass_finished()
assert metrics.COUNTERS.get("completed") == 1
try:
    celery_exactonce.startup.prometheus_module("exactonce_metrics_port")
except ConfigurationError as exc:
    assert exc.setting == "exactonce_metrics_port" and "[prometheus]" in str(exc), exc
else:
    raise AssertionError("not refused")
assert not any(m.startswith("prometheus_client") for m in sys.modules)
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_a_multiprocess_directory_that_cannot_be_written_stops_the_export_not_the_process(
    tmp_path: Path,
) -> None:
    """A process given a PROMETHEUS_MULTIPROC_DIR that does not exist (a container's image
    setting it for every role) goes on, its events counted, with one warning."""
    script = """
import logging
from celery_exactonce.observe import metrics
seen = []
logging.getLogger("celery_exactonce").addHandler(logging.Handler())
logging.getLogger("celery_exactonce").handlers[-1].emit = seen.append
metrics.event("completed", "done", task="t")
metrics.event("completed", "done", task="t")
metrics.reconcile_pass_finished()
assert metrics.COUNTERS.get("completed") == 2
warned = [r.getMessage() for r in seen if "cannot write its values" in r.getMessage()]
assert len(warned) == 1, warned
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "no")}
    done = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_beat_metrics_refuse_a_multiprocess_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(prometheus.MULTIPROC_ENV, str(tmp_path))
    with pytest.raises(ConfigurationError, match="set it for prefork workers only") as refused:
        prometheus.serve_beat(InMemoryStore("ns"), BeatGauges("n"), port=free_port())
    assert refused.value.setting == "exactonce_metrics_port"
