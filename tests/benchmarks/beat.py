"""Beat benchmarks: the cost of a tick, and dispatching a whole slot against plain Celery.

Two figures, each measured in the same run as its baseline:

* **tick cost, none due**: the median time of an idle tick with 1,000 and with
  10,000 entries (every hour, the next slot far away). A tick costs O(due
  entries), so the ratio should stay near 1.
* **one slot, all due**: 10,000 entries share a slot; the time from the tick
  that finds them due to every message being on the broker, against 10,000
  plain ``apply_async`` calls on the same broker. Every message is counted on
  the broker afterwards, so a benchmark that dispatched less fails loudly.

Both run on a Redis broker (``tests/services.py``), on the Redis store or
another shared store (``run``'s ``store``: ``postgres``, ``mysql``, ``sqlite``).
"""

from __future__ import annotations

import shutil
import signal
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import redis
from celery import Celery

from celery_exactonce import runtime
from celery_exactonce.beat.scheduler import ExactOnceScheduler
from celery_exactonce.core.states import State
from tests import services
from tests.support.backends import store_url

#: Broker database of the benchmarks (store tests use 9, acceptance 10).
BROKER_DB = 11
#: Slot length of the "all due" entries: a slot boundary comes by within this many seconds.
SLOT_SECONDS = 10


def _broker_url() -> str:
    return services.REDIS_URL.rsplit("/", 1)[0] + f"/{BROKER_DB}"


@contextmanager
def _app(entries: dict[str, Any], queue: str, store: str = "redis") -> Iterator[Celery]:
    """An app with ``entries`` as its beat schedule, a fresh namespace of ``store``, cleaned
    up after."""
    tmp = tempfile.mkdtemp(prefix="exactonce-bench-beat-")
    app = Celery("bench", set_as_current=False)
    app.conf.update(
        broker_url=_broker_url(),
        task_default_queue=queue,
        task_ignore_result=True,
        beat_schedule=entries,
        timezone="UTC",
        exactonce_store_url=store_url(store, tmp),
        exactonce_namespace=f"bench-{uuid.uuid4().hex[:12]}",
        exactonce_max_skew=0,
        exactonce_tick_interval=1,
    )
    app.task(name="bench.t", shared=False)(_noop)  # beat imports the entries' task
    sigterm = signal.getsignal(signal.SIGTERM)  # the scheduler installs its own
    try:
        yield app
    finally:
        signal.signal(signal.SIGTERM, sigterm)
        try:
            runtime.runtime_for(app).store.drop_namespace()  # type: ignore[attr-defined]
        finally:
            runtime.reset(app)
            drop_queue(queue)
            shutil.rmtree(tmp, ignore_errors=True)


def drop_queue(queue: str) -> None:
    """Remove ``queue`` from the broker, with the bindings kombu keeps for its exchange.

    The exchange is named after the queue (Celery's default exchange of a default queue).
    """
    client = redis.Redis.from_url(_broker_url())
    try:
        client.delete(queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}")
    finally:
        client.close()


def _noop(i: int) -> None:
    """The benchmark task (never run: only published)."""


def _entries(count: int, every: timedelta) -> dict[str, Any]:
    return {f"e{i:05}": {"task": "bench.t", "schedule": every, "args": [i]} for i in range(count)}


def idle_tick_cost(entries: int, ticks: int = 500, store: str = "redis") -> float:
    """Median seconds per tick with ``entries`` entries and none due.

    The median, not the mean: a tick is one store round trip plus a few
    microseconds of work, and the mean would mostly measure network jitter.
    """
    queue = f"bench-idle-{uuid.uuid4().hex}"
    with _app(_entries(entries, timedelta(hours=1)), queue, store) as app:
        scheduler = ExactOnceScheduler(app)
        now = runtime.runtime_for(app).store.now()
        if (now.minute, now.second) >= (59, 30):  # a slot could fall due mid-measure
            time.sleep(60 - now.second + 1)
        scheduler.tick()  # builds the heap: O(entries), once per start
        samples = []
        for _ in range(ticks):
            start = time.perf_counter()
            scheduler.tick()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)


def plain_publish(count: int) -> float:
    """Seconds for ``count`` plain ``apply_async`` calls on the benchmark broker."""
    queue = f"bench-plain-{uuid.uuid4().hex}"
    with _app({}, queue) as app:
        task = app.tasks["bench.t"]
        start = time.perf_counter()
        for i in range(count):
            task.apply_async((i,))
        elapsed = time.perf_counter() - start
        landed = redis.Redis.from_url(_broker_url()).llen(queue)
        if landed != count:
            raise AssertionError(f"plain: {landed} of {count} messages on the broker")
        return elapsed


def beat_slot(count: int, slot_seconds: int = SLOT_SECONDS, store_name: str = "redis") -> float:
    """Seconds for one tick to claim and dispatch ``count`` entries due in the same slot."""
    queue = f"bench-beat-{uuid.uuid4().hex}"
    broker = redis.Redis.from_url(_broker_url())
    with _app(_entries(count, timedelta(seconds=slot_seconds)), queue, store_name) as app:
        store = runtime.runtime_for(app).store
        scheduler = ExactOnceScheduler(app)
        scheduler.tick()  # builds the heap, settles what fell due so far (not measured)
        # The next slot boundary from now: every entry falls due on it, and nothing else
        # falls due before the measured tick starts.
        now = store.now()
        slot = now.replace(microsecond=0) + timedelta(
            seconds=slot_seconds - now.second % slot_seconds
        )
        while store.now() < slot:
            time.sleep(0.01)
        before = broker.llen(queue)
        start = time.perf_counter()
        scheduler.tick()
        elapsed = time.perf_counter() - start
        landed = broker.llen(queue) - before
        published = [
            job for job in store.list_stale(State.PUBLISHED, 0, 3 * count) if job.fire_time == slot
        ]
        if landed != count or len(published) != count:
            raise AssertionError(
                f"beat: {landed} messages on the broker, {len(published)} PUBLISHED, of {count}"
            )
        return elapsed


def run(
    entries: int = 10_000, rounds: int = 3, slot_seconds: int = SLOT_SECONDS, store: str = "redis"
) -> tuple[list[tuple[str, str]], list[float]]:
    """The beat figures as ``(name, value)`` rows, and each pair's ratio (sorted).

    The dispatch ratio is the median of ``rounds`` back-to-back pairs (plain,
    then beat): a shared machine's noise moves both of a pair alike. A round
    waits for a slot boundary: ``slot_seconds`` shorter than the default only
    for small runs, whose tick must end well within it. Also each pair's ratio
    (beat's time over plain's), for the summary.
    """
    small = idle_tick_cost(entries // 10, store=store)
    large = idle_tick_cost(entries, store=store)
    pairs = [
        (plain_publish(entries), beat_slot(entries, slot_seconds, store)) for _ in range(rounds)
    ]
    plain, beat = statistics.median(p for p, _ in pairs), statistics.median(b for _, b in pairs)
    ratios = sorted(b / p for p, b in pairs)
    per_plain, per_beat = f"{entries / plain:,.0f} msg/s", f"{entries / beat:,.0f} msg/s"
    return [
        (f"idle tick, {entries // 10:,} entries", f"{small * 1e3:.3f} ms"),
        (f"idle tick, {entries:,} entries", f"{large * 1e3:.3f} ms"),
        ("idle tick ratio (10x the entries)", f"{large / small:.2f}x"),
        (f"plain apply_async x {entries:,} (median)", f"{plain:.2f} s ({per_plain})"),
        (f"beat, {entries:,} due in one slot (median)", f"{beat:.2f} s ({per_beat})"),
        (f"beat / plain, median of {rounds} pairs", f"{statistics.median(ratios):.2f}x"),
        ("beat / plain, each pair", " ".join(f"{r:.2f}x" for r in ratios)),
    ], ratios
