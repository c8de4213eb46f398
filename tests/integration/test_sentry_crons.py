"""Sentry Crons under ExactOnceScheduler: one check-in pair per occurrence, not one per node.

Two beat nodes (two apps, in this process) share an in-memory store on a
frozen clock and publish to Celery's in-memory broker; an in-process worker
runs the occurrences. Sentry is initialised with its Celery integration
(``monitor_beat_tasks=True``) and a transport that keeps every envelope.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sentry_sdk
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.schedules import crontab
from sentry_sdk.integrations.celery import CeleryIntegration
from sentry_sdk.integrations.celery import beat as sentry_beat
from sentry_sdk.transport import Transport

from celery_exactonce import ExactOnceTask, runtime
from celery_exactonce.beat.scheduler import ExactOnceScheduler
from celery_exactonce.core.jobs import Job
from celery_exactonce.observe import metrics
from celery_exactonce.observe import sentry_crons as crons
from celery_exactonce.testing import FrozenClock, InMemoryStore
from tests.support.beat_cluster import Cluster, every, isolated
from tests.support.helpers import poll

START = datetime(2026, 6, 1, 12, 0, 0, tzinfo=timezone.utc)
MINUTES = 5

SCHEDULE: dict[str, Any] = {
    "minutely": {"task": "crons.plain", "schedule": timedelta(minutes=1)},
    "every-2-min": {"task": "crons.gated", "schedule": crontab(minute="*/2")},
    # Sentry monitors no interval under a minute: these run, with no check-in
    "fast": {"task": "crons.plain", "schedule": timedelta(seconds=20)},
}
MONITORED = {"minutely", "every-2-min"}


class Capture(Transport):  # type: ignore[misc]  # sentry_sdk's Transport is untyped here
    """Keeps the payload of every check-in envelope item."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.check_ins: list[dict[str, Any]] = []

    def capture_envelope(self, envelope: Any) -> None:
        with self.lock:
            self.check_ins += [i.payload.json for i in envelope.items if i.type == "check_in"]


@pytest.fixture
def transport() -> Iterator[Capture]:
    capture = Capture()
    sentry_sdk.init(
        dsn="https://key@sentry.invalid/1",
        transport=capture,
        default_integrations=False,
        auto_enabling_integrations=False,
        integrations=[CeleryIntegration(monitor_beat_tasks=True)],
    )
    try:
        yield capture
    finally:
        sentry_sdk.init(dsn=None)


def beat_app(store: InMemoryStore, node: str, runs: list[str]) -> Celery:
    app = Celery(f"crons-{node}", broker="memory://", set_as_current=False)
    app.conf.update(
        timezone="UTC",
        beat_schedule=SCHEDULE,
        exactonce_store_url="memory://",
        exactonce_node_id=node,
        task_ignore_result=True,
    )

    @app.task(name="crons.plain", shared=False, bind=True)
    def plain(self: Any) -> None:
        runs.append(self.request.id)

    @app.task(name="crons.gated", shared=False, bind=True, base=ExactOnceTask)
    def gated(self: Any) -> None:
        runs.append(self.request.id)

    runtime.install(app, store)
    return app


def occurrences(store: InMemoryStore) -> list[Job]:
    """The beat occurrences the store holds (but the reconciler's own)."""
    jobs = list(store._jobs.values())  # the in-memory store's records, for a test's count
    return [job for job in jobs if job.entry is not None and job.entry in SCHEDULE]


def test_two_beats_make_one_in_progress_and_one_ok_check_in_per_occurrence(
    transport: Capture,
) -> None:
    # Given two beat nodes on one store, and a worker
    clock = FrozenClock(START - timedelta(days=1))
    store = InMemoryStore("crons", clock=clock)
    store.epoch()  # born a day ago: no slot is held back
    clock.set(START)
    runs: list[str] = []
    apps = [beat_app(store, node, runs) for node in ("beat-a", "beat-b")]
    beats = [ExactOnceScheduler(app) for app in apps]
    try:
        with start_worker(apps[0], pool="solo", perform_ping_check=False, shutdown_timeout=10):
            # When both tick every 20 s for five minutes, in turns
            for step in range(MINUTES * 3):
                clock.advance(20)
                for beat in beats if step % 2 else beats[::-1]:
                    beat.tick()
            dispatched = occurrences(store)
            poll(lambda: len(runs) >= len(dispatched), timeout=30)
        sentry_sdk.flush(timeout=5)
    finally:
        for app in apps:
            runtime.reset(app)
    # Then every occurrence ran once, and each monitored one has exactly one
    # in_progress and one ok check-in, under the id its job derives
    assert sorted(runs) == sorted(job.ref.id for job in dispatched)
    monitored = {crons.check_in_id(j.ref.id): j.entry for j in dispatched if j.entry in MONITORED}
    assert len(monitored) >= MINUTES + MINUTES // 2
    assert {job.node for job in dispatched if job.entry in MONITORED} == {"beat-a", "beat-b"}
    check_ins = transport.check_ins
    pairs = Counter((c["check_in_id"], c["status"]) for c in check_ins)
    assert pairs == Counter({(cid, s): 1 for cid in monitored for s in ("in_progress", "ok")})
    assert all(c["monitor_slug"] == monitored[c["check_in_id"]] for c in check_ins)
    in_progress = [c for c in check_ins if c["status"] == "in_progress"]
    assert {c["monitor_config"]["schedule"]["type"] for c in in_progress} == {
        "interval",
        "crontab",
    }


def test_excluded_entries_and_entries_sentry_cannot_follow_get_no_headers(
    transport: Capture,
) -> None:
    app = Celery("crons-headers", set_as_current=False)
    app.conf.timezone = "Europe/Berlin"
    sentry_sdk.init(
        dsn="https://key@sentry.invalid/1",
        transport=transport,
        default_integrations=False,
        auto_enabling_integrations=False,
        integrations=[CeleryIntegration(monitor_beat_tasks=True, exclude_beat_tasks=["skip-.*"])],
    )
    monitor = crons.Crons(app)
    headers = monitor.headers("nightly", crontab(hour=3, minute=0, app=app), "job-1")
    assert headers == {
        crons.SLUG: "nightly",
        crons.CONFIG: {
            "schedule": {"type": "crontab", "value": "0 3 * * *"},
            "timezone": "Europe/Berlin",
        },
        crons.CHECK_IN: crons.check_in_id("job-1"),
    }
    assert monitor.headers("skip-me", crontab(), "job-2") is None
    assert monitor.headers("fast", timedelta(seconds=30), "job-3") is None
    # Without monitor_beat_tasks, or without Sentry, nothing is added
    sentry_sdk.init(
        dsn="https://key@sentry.invalid/1",
        transport=transport,
        default_integrations=False,
        auto_enabling_integrations=False,
        integrations=[CeleryIntegration()],
    )
    assert monitor.headers("nightly", crontab(hour=3, minute=0, app=app), "job-1") is None
    sentry_sdk.init(dsn=None)
    assert monitor.headers("nightly", crontab(hour=3, minute=0, app=app), "job-1") is None


def test_beat_never_imports_sentry_sdk_itself() -> None:
    script = (
        "import sys\n"
        "from tests.support.beat_cluster import Cluster, every\n"
        "cluster = Cluster({'fast': every(1)}, nodes=2)\n"
        "cluster.run(5)\n"
        "assert cluster.fired('fast'), 'nothing dispatched'\n"
        "print(sorted(m for m in sys.modules if m.startswith('sentry_sdk')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_failing_sdk_turns_check_ins_off_on_the_node_and_beat_goes_on(
    transport: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def changed(*_args: Any, **_kwargs: Any) -> Any:
        raise AttributeError("an SDK whose internals changed")

    monkeypatch.setattr(sentry_beat, "_get_monitor_config", changed)
    with isolated():
        cluster = Cluster({"minutely": every(60)}, nodes=2)
        cluster.run(240, step=20)
        assert len(cluster.fired("minutely")) >= 4
        assert metrics.COUNTERS.get("crons_failed") in (1, 2)  # at most once per node
    assert all("headers" not in job.options for job in cluster.broker.sent)
    sentry_sdk.flush(timeout=5)
    assert transport.check_ins == []
