"""What beat logs: a send line per occurrence it dispatched, its start, and the epoch guard once."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest

from celery_exactonce import ExactOnceConfig
from celery_exactonce.beat import log as beat_log
from celery_exactonce.beat.store_loss import StoreLossGuard
from celery_exactonce.core import keys
from celery_exactonce.core.refs import EPOCH_SEPARATOR, JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.times import to_micros
from celery_exactonce.core.writes import NewJob
from celery_exactonce.observe import metrics
from tests.support.beat_cluster import START, Cluster, every, isolated

#: Stock beat's line, and the occurrence it names.
SEND_LINE = re.compile(
    r"^Scheduler: Sending due task (?P<entry>\S+) \((?P<task>\S+)\) key=(?P=entry) "
    r"fire_time=(?P<fire>\S+Z) idempotency_key=(?P<key>eo1_[0-9a-f]+)$"
)


@pytest.fixture(autouse=True)
def _counters_and_signals() -> Iterator[None]:
    with isolated():
        yield


def _records(caplog: pytest.LogCaptureFixture, action: str, level: int = logging.INFO) -> list[Any]:
    return [
        r for r in caplog.records if getattr(r, "action", None) == action and r.levelno >= level
    ]


def test_each_node_logs_one_send_line_per_occurrence_it_dispatched_and_none_for_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given two beat nodes of two entries, ticking in turn (each wins some slots)
    cluster = Cluster({"fast": every(1, "plain.a"), "slow": every(3, "plain.b")}, nodes=2)
    lines: dict[int, list[Any]] = {0: [], 1: []}
    published_by: dict[str, int] = {}
    end = START + timedelta(seconds=30)
    first = 0
    with caplog.at_level(logging.INFO, logger="celery_exactonce"):
        while cluster.clock.now() < end:
            cluster.clock.advance(1)
            for index in (first, 1 - first):
                caplog.clear()
                sent_before = len(cluster.broker.sent)
                cluster.nodes[index].tick()
                for job in cluster.broker.sent[sent_before:]:
                    published_by[job.ref.id] = index
                lines[index] += [
                    r
                    for r in caplog.records
                    if r.levelno == logging.INFO and getattr(r, "action", "") == "dispatched"
                ]
            first = 1 - first
    # Then each node's send lines name exactly the occurrences it published
    assert len(published_by) >= 40 and set(published_by.values()) == {0, 1}
    for index, records in lines.items():
        ids = [r.job_id for r in records]
        assert len(ids) == len(set(ids))
        assert set(ids) == {job_id for job_id, node in published_by.items() if node == index}
    # ... in stock beat's shape, with the key, the fire time and the idempotency key
    for record in lines[0] + lines[1]:
        match = SEND_LINE.match(record.getMessage())
        assert match is not None, record.getMessage()
        fire = datetime.fromisoformat(match["fire"].replace("Z", "+00:00"))
        assert match["key"] == keys.idempotency_key(match["entry"], fire, "beat")
        assert match["task"] == {"fast": "plain.a", "slow": "plain.b"}[match["entry"]]
        assert record.key == match["entry"]


def test_a_delayed_jobs_dispatch_is_no_send_line(caplog: pytest.LogCaptureFixture) -> None:
    # Given a delayed job, due in 5 s, as ``apply_async(eta=...)`` stores it
    cluster = Cluster({}, nodes=1)
    run_at = cluster.clock.now() + timedelta(seconds=5)
    new = NewJob(JobRef.submitted("d1"), "plain.t", State.PENDING, node="client", run_at=run_at)
    assert cluster.store.create(new).created
    # When beat's sweep dispatches it, then it is dispatched once, logged at debug only
    with caplog.at_level(logging.DEBUG, logger="celery_exactonce"):
        cluster.run(10)
    dispatched = [r for r in caplog.records if getattr(r, "action", "") == "dispatched"]
    assert len(dispatched) == 1 and dispatched[0].levelno == logging.DEBUG


def test_a_node_says_once_that_it_started_with_its_store_namespace_epoch_and_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cluster = Cluster({"fast": every(1)}, nodes=2)
    with caplog.at_level(logging.INFO, logger="celery_exactonce"):
        cluster.run(5)
    started = _records(caplog, "beat_started")
    assert len(started) == 2  # one per node, at its first tick
    epoch = cluster.store.epoch()
    for record in started:
        assert record.epoch == epoch and record.namespace == "default"
        assert record.node == cluster.nodes[0]._runtime.node
        assert epoch in record.getMessage() and "memory://" in record.getMessage()


def test_the_start_line_redacts_the_stores_credentials(caplog: pytest.LogCaptureFixture) -> None:
    config = ExactOnceConfig(store_url="redis://beat:s3cret@store.example:6379/1", namespace="ns")
    guard = StoreLossGuard(max_skew=5, window_lookback=300)
    guard.adopt(f"e1{EPOCH_SEPARATOR}{to_micros(START - timedelta(days=1))}")
    with caplog.at_level(logging.INFO, logger="celery_exactonce"):
        beat_log.started(config, "node-1", guard, START)
    (record,) = caplog.records  # an epoch a day old holds nothing back: no guard message
    message = record.getMessage()
    assert record.action == "beat_started"  # type: ignore[attr-defined]
    assert "s3cret" not in message and "store.example:6379/1" in message
    assert "node-1" in message and "namespace ns" in message and "e1" in message


def test_a_first_start_explains_the_epoch_guard_once_and_skips_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a brand-new store (its epoch born as beat starts): slots before
    # birth + max_skew (5 s) are held back
    cluster = Cluster({"fast": every(1), "other": every(1)}, nodes=2, store_born=START)
    with caplog.at_level(logging.DEBUG, logger="celery_exactonce"):
        cluster.run(20)
    # Then one message per node says so, in plain words, once
    guard = _records(caplog, "epoch_guard")
    assert len(guard) == 2
    message = guard[0].getMessage()
    floor = START + timedelta(seconds=5)
    assert floor.isoformat() in message and "no slot runs twice" in message
    assert "exactonce_max_skew" in message and "where=unprovable" in message
    # ... the skipped slots are counted but never reported above debug
    assert metrics.COUNTERS.get("slot_skipped", where="unprovable") > 0
    skipped = [
        r for r in _records(caplog, "slot_skipped", logging.DEBUG) if r.where == "unprovable"
    ]
    assert skipped and all(r.levelno == logging.DEBUG for r in skipped)
    assert all(r.levelno < logging.WARNING for r in caplog.records)
    # ... and every slot after the floor was dispatched
    assert cluster.fired("fast")[0] == floor + timedelta(seconds=1)


def test_no_guard_message_for_an_old_epoch(caplog: pytest.LogCaptureFixture) -> None:
    cluster = Cluster({"fast": every(1)}, nodes=1)  # the store was born a day ago
    with caplog.at_level(logging.DEBUG, logger="celery_exactonce"):
        cluster.run(5)
    assert _records(caplog, "beat_started") and not _records(caplog, "epoch_guard", logging.DEBUG)
