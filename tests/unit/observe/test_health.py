"""Liveness and readiness: beat's and a worker's verdicts, and the paths that serve them."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from celery_exactonce.core.exceptions import StoreUnavailable
from celery_exactonce.observe import health, prometheus
from celery_exactonce.observe.gauges import BeatGauges
from celery_exactonce.observe.health import BeatProbes, Verdict, WorkerProbes
from tests.integration.servers import free_port
from tests.support import probes


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def beat_probes(
    tick_interval: float = 1.0, errors: list[float] | None = None
) -> tuple[BeatProbes, BeatGauges, Clock]:
    clock = Clock()
    errors = [] if errors is None else errors

    def last_error() -> float | None:
        return errors[-1] if errors else None

    gauges = BeatGauges("node-a", wall=lambda: 0.0, monotonic=clock, store_errors=last_error)
    return BeatProbes(gauges, tick_interval), gauges, clock


def test_beat_is_live_until_no_tick_ended_for_the_stall_time() -> None:
    probes, gauges, clock = beat_probes()
    clock.now += 59
    assert probes.live() == Verdict(True, "no tick yet; started 59.0 s ago (stuck after 60 s)")
    with gauges.ticking():
        clock.now += 2
    clock.now += 59.5
    assert probes.live().ok
    clock.now += 1
    verdict = probes.live()
    assert not verdict.ok
    assert verdict.why == "the last tick ended 60.5 s ago (stuck after 60 s)"


def test_a_tick_that_hangs_makes_beat_not_live() -> None:
    probes, gauges, clock = beat_probes()
    stuck = gauges.ticking()
    stuck.__enter__()
    clock.now += 30
    assert probes.live().why.startswith("the tick in progress began 30.0 s ago")
    assert probes.live().ok
    clock.now += 31
    assert not probes.live().ok  # the last tick's end is older, and does not count


def test_the_stall_time_grows_with_a_long_tick_interval() -> None:
    assert health.stall_after(1.0) == health.STALL_FLOOR
    assert health.stall_after(30.0) == 300.0
    probes, _, clock = beat_probes(tick_interval=30.0)
    clock.now += 299
    assert probes.live().ok


def test_a_store_call_that_failed_during_a_tick_makes_beat_not_ready() -> None:
    errors: list[float] = []
    probes, gauges, clock = beat_probes(errors=errors)
    with gauges.ticking():
        gauges.reached()
    assert probes.ready().ok
    errors.append(clock.now - 5)  # an error before this tick: not this tick's
    with gauges.ticking():
        gauges.reached()
        clock.now += 1
        errors.append(clock.now)  # a claim's write failed (fail_closed)
    verdict = probes.ready()
    assert not verdict.ok
    assert verdict.why == (
        "the last tick could not reach the store: a store call failed during it "
        "(fail_closed in beat's log)"
    )
    clock.now += 1
    with gauges.ticking():
        gauges.reached()
    assert probes.ready().ok  # the next tick went well


def test_beat_is_ready_when_its_last_tick_reached_the_store() -> None:
    probes, gauges, _ = beat_probes()
    assert probes.ready() == Verdict(False, "no tick has reached the store yet")
    gauges.reached()
    assert probes.ready() == Verdict(True, "the last tick reached the store")
    gauges.reached(StoreUnavailable("Redis store redis://h:6379/1: Connection\nrefused"))
    verdict = probes.ready()
    assert not verdict.ok
    assert verdict.why == (
        "the last tick could not reach the store: Redis store redis://h:6379/1: Connection refused"
    )
    assert probes.live().ok  # a store that is down is no reason to restart beat


def worker(state: int = 1, consumer_state: int | None = 1, connected: bool = True) -> Any:
    consumer = (
        None
        if consumer_state is None
        else SimpleNamespace(
            blueprint=SimpleNamespace(state=consumer_state),
            connection=SimpleNamespace(connected=connected),
        )
    )
    return SimpleNamespace(blueprint=SimpleNamespace(state=state), consumer=consumer)


@pytest.fixture
def asked() -> list[int]:
    return []


def test_a_worker_is_ready_when_connected_and_the_store_answers(asked: list[int]) -> None:
    probes = WorkerProbes(worker(), lambda: asked.append(1))
    try:
        assert probes.live() == Verdict(True, "the worker's main process answers")
        assert probes.ready() == Verdict(True, "connected to the broker; the store answers")
    finally:
        probes.close()


@pytest.mark.parametrize(
    ("w", "why"),
    [
        (worker(consumer_state=None), "the worker's consumer has not started"),
        (worker(consumer_state=0), "the worker's consumer is not running"),
        (worker(connected=False), "the worker is not connected to the broker"),
        (worker(state=2), "the worker is stopping"),
    ],
)
def test_a_worker_off_its_broker_is_not_ready(w: Any, why: str) -> None:
    probes = WorkerProbes(w, lambda: None)
    try:
        verdict = probes.ready()
        assert not verdict.ok
        assert verdict.why.startswith(why)
        assert probes.live().ok == (why != "the worker is stopping")
    finally:
        probes.close()


def test_a_worker_whose_store_fails_or_hangs_is_not_ready() -> None:
    release = threading.Event()
    answers: list[Any] = [StoreUnavailable("connection refused"), release.wait, None]

    def store_now() -> object:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer() if callable(answer) else answer

    clock = Clock()
    probes = WorkerProbes(worker(), store_now, wait=0.2, monotonic=clock)
    try:
        assert probes.ready() == Verdict(False, "the store did not answer: connection refused")
        # A failed answer is asked again at once; this one hangs past the wait.
        assert probes.ready() == Verdict(False, "the store did not answer within 0.2 s")
        release.set()
        assert probes.ready().ok  # the same question, answered meanwhile: not asked again
        assert answers == [None]
        clock.now += health.STORE_MAX_AGE
        assert probes.ready().ok
        assert answers == []  # asked again once the answer was older than its age
    finally:
        probes.close()


def test_the_answer_is_asked_once_within_its_age(asked: list[int]) -> None:
    clock = Clock()
    probes = WorkerProbes(worker(), lambda: asked.append(1), monotonic=clock)
    try:
        for _ in range(5):
            assert probes.ready().ok
        assert asked == [1]
    finally:
        probes.close()


@pytest.fixture
def served() -> Iterator[int]:
    with probes.served(Verdict(True, "ticking"), Verdict(False, "store down")) as port:
        yield port


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_the_metrics_port_answers_healthz_readyz_and_metrics(served: int) -> None:
    assert get(served, "/healthz") == (200, "ok: ticking\n")
    assert get(served, "/readyz") == (503, "failing: store down\n")
    status, text = get(served, "/metrics")
    assert status == 200
    assert "ticking" not in text


def test_without_probes_every_path_is_the_metrics() -> None:
    from prometheus_client import CollectorRegistry, Counter

    registry = CollectorRegistry()
    Counter("probe_test", "a counter", registry=registry).inc()
    server = prometheus.MetricsServer(free_port(), "127.0.0.1", registry, setting="x")
    try:
        status, text = get(server.port, "/healthz")
        assert status == 200
        assert "probe_test_total 1.0" in text
    finally:
        server.close()
