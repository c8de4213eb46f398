"""Sentry events, through a transport that keeps them: failed rollbacks, fail-closed bursts,
timeouts and skipped slots, each tagged with its task, key and state."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sentry_sdk
from sentry_sdk.transport import Transport

from celery_exactonce import StoreUnavailable
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.dispatch.dispatcher import Dispatcher
from celery_exactonce.dispatch.messages import GATED_OPTION
from celery_exactonce.dispatch.publisher import PublishFailed
from celery_exactonce.observe import metrics
from celery_exactonce.testing import InMemoryStore
from tests.support.beat_cluster import Cluster, every, isolated
from tests.support.reconciler_world import RUNNING_TIMEOUT, World

FIRE = datetime(2026, 6, 1, 3, 0, tzinfo=timezone.utc)


class Capture(Transport):  # type: ignore[misc]  # sentry_sdk's Transport is untyped here
    """Keeps every event sent (not the check-ins, sessions...)."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.events: list[dict[str, Any]] = []

    def capture_envelope(self, envelope: Any) -> None:
        with self.lock:
            self.events += [i.payload.json for i in envelope.items if i.type == "event"]

    def tags(self, action: str) -> list[dict[str, str]]:
        sentry_sdk.flush(timeout=5)
        with self.lock:
            found = [event.get("tags") or {} for event in self.events]
        return [tags for tags in found if tags.get("exactonce.action") == action]


@pytest.fixture
def sentry() -> Iterator[Capture]:
    capture = Capture()
    with isolated():
        metrics.BURSTS.reset()
        sentry_sdk.init(
            dsn="https://key@sentry.invalid/1",
            transport=capture,
            default_integrations=False,
            auto_enabling_integrations=False,
        )
        try:
            yield capture
        finally:
            sentry_sdk.init(dsn=None)
            metrics.BURSTS.reset()


def occurrence(store: InMemoryStore, entry: str = "nightly-billing") -> Job:
    new = NewJob(
        JobRef.occurrence(f"occ-{entry}"),
        "billing.charge",
        State.SCHEDULED,
        node="n",
        options={GATED_OPTION: True},
        entry=entry,
        fire_time=FIRE,
    )
    created = store.create(new)
    assert created.job is not None
    return created.job


class DownStore(InMemoryStore):
    """A store every transition of which fails, and so does reading back."""

    down = False

    def transition_many(self, *args: Any, **kwargs: Any) -> Any:
        if self.down:
            raise StoreUnavailable("injected")
        return super().transition_many(*args, **kwargs)

    def transition(self, *args: Any, **kwargs: Any) -> Any:
        if self.down:
            raise StoreUnavailable("injected")
        return super().transition(*args, **kwargs)

    def get(self, *args: Any, **kwargs: Any) -> Any:
        if self.down:
            raise StoreUnavailable("injected")
        return super().get(*args, **kwargs)


def test_a_failed_rollback_is_one_event_tagged_with_task_key_and_state(sentry: Capture) -> None:
    store = DownStore("ns")
    job = occurrence(store)

    def refuse_then_lose_the_store(job: Job, headers: Mapping[str, Any], extra: Any) -> None:
        store.down = True
        raise PublishFailed("refused", definite=True)

    Dispatcher(store, refuse_then_lose_the_store, node="n").dispatch(job, retry=False)
    (tags,) = sentry.tags("rollback_failed")
    assert tags["exactonce.task"] == "billing.charge"
    assert tags["exactonce.key"] == "nightly-billing"
    assert tags["exactonce.state"] == "DISPATCHED"
    assert tags["exactonce.job_id"] == job.ref.id and tags["exactonce.phase"] == "rollback_write"


def test_a_fail_closed_burst_is_one_event_and_the_next_tells_how_many_were_held_back(
    sentry: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr(metrics.BURSTS, "clock", lambda: now[0])
    store = DownStore("ns")
    jobs = [occurrence(store, f"entry-{i}") for i in range(10)]
    store.down = True
    dispatcher = Dispatcher(store, lambda *_: None, node="n")
    # When a store outage fails ten dispatches closed
    dispatcher.dispatch_many(jobs, retry=False)
    # Then all ten are counted, and Sentry hears once, of the first, with its job
    assert metrics.COUNTERS.get("fail_closed", phase="dispatched_write") == 10
    (first,) = sentry.tags("fail_closed")
    assert first["exactonce.phase"] == "dispatched_write" and "exactonce.held_back" not in first
    assert (first["exactonce.key"], first["exactonce.state"]) == ("entry-0", "SCHEDULED")
    assert first["exactonce.task"] == "billing.charge"
    # ... and again a minute later, saying how many it did not send
    now[0] += metrics.SENTRY_BURSTS["fail_closed"]
    dispatcher.dispatch_many(jobs[:1], retry=False)
    assert [t.get("exactonce.held_back") for t in sentry.tags("fail_closed")] == [None, "9"]


def test_a_timeout_is_an_event_tagged_with_task_and_state(sentry: Capture) -> None:
    world = World()
    job = world.put(State.RUNNING)
    world.advance(RUNNING_TIMEOUT)
    assert world.run().timed_out == 1
    (tags,) = sentry.tags("timed_out")
    assert (tags["exactonce.task"], tags["exactonce.state"]) == (job.task, "RUNNING")
    assert tags["exactonce.job_id"] == job.ref.id


def test_slots_no_node_claimed_in_the_window_are_an_event_but_a_catch_up_is_not(
    sentry: Capture,
) -> None:
    # Given two entries whose nodes all stop, and come back within the window
    cluster = Cluster(
        {"often": every(1, "plain.often"), "rare": every(10, "plain.rare")},
        nodes=2,
        exactonce_window_lookback=60,
    )
    cluster.run(5)
    cluster.clock.advance(30)
    cluster.run(2)
    # Then the catch-up policy's skips go to the log and the counters only
    assert metrics.COUNTERS.get("slot_skipped", where="catchup") > 0
    assert sentry.tags("slot_skipped") == []
    # When they stop for longer than window_lookback
    cluster.clock.advance(300)
    cluster.run(2)
    # Then the slots lost are one event per burst, naming the entry, its task and the reason
    assert metrics.COUNTERS.get("slot_skipped", where="window") > 0
    (tags,) = sentry.tags("slot_skipped")
    assert tags["exactonce.where"] == "window"
    assert (tags["exactonce.key"], tags["exactonce.task"]) in {
        ("often", "plain.often"),
        ("rare", "plain.rare"),
    }


def test_nothing_is_sent_when_the_app_did_not_initialise_sentry() -> None:
    with isolated():
        metrics.BURSTS.reset()
        assert not metrics.report_to_sentry("rollback_failed", "boom", {"task": "t"})
        metrics.event("fail_closed", "store down", labels={"phase": "tick_read"}, sentry=True)
    assert metrics.COUNTERS.get("fail_closed", phase="tick_read") == 1


def test_bursts_are_per_action_and_labels() -> None:
    bursts = metrics.Bursts()
    now = [0.0]
    bursts.clock = lambda: now[0]
    assert bursts.admit("fail_closed", {"phase": "a"}, 60) == 0
    assert bursts.admit("fail_closed", {"phase": "a"}, 60) is None
    assert bursts.admit("fail_closed", {"phase": "b"}, 60) == 0
    now[0] = 59.9
    assert bursts.admit("fail_closed", {"phase": "a"}, 60) is None
    now[0] = 60.0
    assert bursts.admit("fail_closed", {"phase": "a"}, 60) == 2
    assert timedelta(seconds=metrics.SENTRY_BURSTS["slot_skipped"]) == timedelta(minutes=1)
