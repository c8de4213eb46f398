"""Beat with many entries: the cost of a tick, memory per entry, and start-up time, per size.

For each size (1,000 / 10,000 / 100,000 entries by default) an
``ExactOnceScheduler`` is built in this process on a store, with that many
entries whose next slots are spread over a day (each a daily crontab at its
own minute, every minute of the day used, none due in the measured hour), plus
:data:`FEW` entries that fall due together every minute ("a few due"). Per size:

* **start-up**: the scheduler's construction (every entry checked) and its
  first tick (the heap of entries by next slot built);
* **memory per entry**: what the process holds more after the start-up, per
  entry (tracemalloc's traced bytes, and the resident set's growth), the
  schedule's own dicts excluded;
* **idle tick**: the median of many ticks with nothing due;
* **tick, a few due**: the median of ticks that each claim and dispatch the
  :data:`FEW` entries due at a minute boundary.

The figure is the ratio of each tick at the largest size to the same tick at
the smallest: a tick should cost what its due entries cost, whatever the
entry count.

Two stores: ``memory`` (an ``InMemoryStore`` on a frozen clock, moved a
minute per "few due" tick, so no waiting: the scheduler's own cost), and
``redis`` (the Redis store at ``tests/services.py``'s server, database
:data:`STORE_DB`, on the server's clock: a "few due" tick waits for the next
second boundary, its entries due every second). Publishing is a no-op
recorder on both (the broker's cost is the ``beat`` suite's): what is
measured is the scheduler and the store.
"""

from __future__ import annotations

import gc
import os
import signal
import statistics
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from celery import Celery
from celery.schedules import crontab

from celery_exactonce import runtime
from celery_exactonce.beat.scheduler import ExactOnceScheduler
from celery_exactonce.core.jobs import Job
from celery_exactonce.dispatch.dispatcher import Dispatcher
from celery_exactonce.stores import InMemoryStore, store_from_url
from celery_exactonce.stores.base import StateStore
from celery_exactonce.stores.redis.store import RedisStore
from celery_exactonce.testing import FrozenClock
from tests import services

#: The Redis database of this suite's stores (tests use 0, 1, 7-14; see tests/services.py).
STORE_DB = 15
#: Entries that fall due together, at each measured "a few due" tick.
FEW = 5
#: Minutes of a day: the spread entries' slots.
DAY_MINUTES = 24 * 60
#: The memory store's start: a minute boundary (the store is born a day earlier).
START = datetime(2026, 6, 1, 12, 0, 0, tzinfo=timezone.utc)
#: How often the due entries fall due on the Redis store (real time: each due tick waits).
REDIS_EVERY = timedelta(seconds=2)
#: Idle ticks on Redis stop this long before a slot, so that none of them finds it due.
REDIS_MARGIN = timedelta(seconds=0.2)


class Recorder:
    """The publisher: counts the due entries' jobs handed to it (nothing reaches a broker).

    Beat's own reconcile entry, published as a task, is not counted.
    """

    def __init__(self) -> None:
        self.sent = 0

    def __call__(self, job: Job, headers: Mapping[str, Any], extra: Mapping[str, Any]) -> None:
        self.sent += (job.entry or "").startswith("few")


@dataclass
class Figures:
    """One size's figures on one store."""

    entries: int
    startup: float  # seconds: construction + first tick
    traced_per_entry: float  # bytes
    rss_per_entry: float  # bytes
    idle_tick: float  # seconds (median)
    due_tick: float  # seconds (median), FEW entries due


def spread_entries(count: int, start: datetime) -> dict[str, Any]:
    """``count`` daily entries, each at a minute of the day in turn.

    The minutes of the three hours from ``start``'s are left out, so nothing of
    them falls due while the ticks are measured: their slots cover the other 21
    hours of the day, about ``count / 1260`` entries a minute.
    """
    quiet = {(start.hour + k) % 24 for k in range(3)}
    minutes = [m for m in range(DAY_MINUTES) if m // 60 not in quiet]
    return {
        f"d{i:06}": {
            "task": "bench.t",
            "schedule": crontab(minute=m % 60, hour=m // 60),
            "args": [i],
        }
        for i, m in ((i, minutes[i % len(minutes)]) for i in range(count))
    }


def few_entries(every: timedelta) -> dict[str, Any]:
    """:data:`FEW` entries due together every ``every`` (intervals are anchored at the epoch)."""
    return {f"few{i}": {"task": "bench.t", "schedule": every, "args": [i]} for i in range(FEW)}


def _rss() -> int:
    """This process's resident set, in bytes (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


@contextmanager
def _app(schedule: dict[str, Any], store: StateStore) -> Iterator[tuple[Celery, Recorder]]:
    """An app with ``schedule`` as its beat schedule on ``store``, publishing to a recorder."""
    app = Celery("bench-entries", set_as_current=False)
    app.conf.update(
        beat_schedule=schedule,
        timezone="UTC",
        exactonce_store_url="memory://",
        exactonce_max_skew=0,
        exactonce_tick_interval=1,
        # The reconciler on beat's thread would compete with the ticks measured.
        exactonce_reconcile_on="worker",
    )
    app.task(name="bench.t", shared=False)(_noop)  # beat imports the entries' task
    recorder = Recorder()
    rt = runtime.install(app, store)
    rt.dispatcher = Dispatcher(store, recorder, node="bench")
    sigterm = signal.getsignal(signal.SIGTERM)  # the scheduler installs its own
    try:
        yield app, recorder
    finally:
        signal.signal(signal.SIGTERM, sigterm)
        runtime.reset(app)


def _noop(i: int) -> None:
    """The benchmark task (never run: only published)."""


def start_up(app: Celery, entries: int) -> tuple[ExactOnceScheduler, float, float, float]:
    """The scheduler built and ticked once: it, the seconds, traced and RSS bytes per entry.

    Timed without tracemalloc (which slows allocation several times); the
    traced bytes come from a second start-up, whose scheduler is dropped.
    """
    gc.collect()
    rss = _rss()
    begin = time.perf_counter()
    scheduler = ExactOnceScheduler(app)
    scheduler.tick()
    seconds = time.perf_counter() - begin
    gc.collect()
    rss_per_entry = (_rss() - rss) / entries
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        traced = ExactOnceScheduler(app)
        traced.tick()
        gc.collect()
        traced_per_entry = (tracemalloc.get_traced_memory()[0] - before) / entries
    finally:
        tracemalloc.stop()
    del traced
    return scheduler, seconds, traced_per_entry, rss_per_entry


class Node:
    """One size's scheduler on its own store, and how to make its ticks idle or due."""

    def __init__(
        self,
        entries: int,
        store: StateStore,
        every: timedelta,
        clock: FrozenClock | None,
        stack: ExitStack,
    ) -> None:
        self.entries, self.store, self.clock, self.every = entries, store, clock, every
        schedule = {**spread_entries(entries, store.now()), **few_entries(every)}
        self.app, self.recorder = stack.enter_context(_app(schedule, store))
        self.scheduler, self.startup, self.traced, self.rss = start_up(self.app, entries)
        if clock is not None:
            clock.advance(1)
        self.scheduler.tick()  # settles what fell due since
        self.due_sent = 0  # the due entries' jobs published by the due ticks

    def idle(self) -> float:
        if self.clock is not None:
            self.clock.advance(0.001)
        return _timed(self.scheduler.tick)

    def due(self, slot: datetime) -> float:
        if self.clock is not None:
            self.clock.set(slot)
        before = self.recorder.sent
        elapsed = _timed(self.scheduler.tick)
        self.due_sent += self.recorder.sent - before
        return elapsed


def _memory_store(stack: ExitStack) -> tuple[StateStore, FrozenClock]:
    clock = FrozenClock(START - timedelta(days=1))
    store = InMemoryStore(f"bench-{uuid.uuid4().hex[:8]}", clock=clock)
    store.epoch()  # born a day before START: every slot measured is provable
    clock.set(START)
    return store, clock


def _redis_store(stack: ExitStack) -> tuple[StateStore, None]:
    url = services.REDIS_URL.rsplit("/", 1)[0] + f"/{STORE_DB}"
    store = store_from_url(url, namespace=f"bench-{uuid.uuid4().hex[:12]}")
    assert isinstance(store, RedisStore)
    store.setup()
    stack.callback(store.drop_namespace)
    return store, None


def measure(kind: str, sizes: list[int], idle_ticks: int, due_ticks: int) -> list[Figures]:
    """Every size's scheduler built, then their ticks interleaved (a neighbour's load
    slows all sizes alike): ``idle_ticks`` idle and ``due_ticks`` due ticks each.

    ``memory``: an ``InMemoryStore`` per size, each on a frozen clock moved a
    minute per due tick. ``redis``: a namespace per size on the server's clock;
    the due entries fall due every :data:`REDIS_EVERY`, each due tick waits for
    its slot, and the idle ticks are taken between slots.
    """
    with ExitStack() as stack:
        nodes: list[Node] = []
        for n in sizes:
            store, clock = (_memory_store if kind == "memory" else _redis_store)(stack)
            every = timedelta(minutes=1) if clock is not None else REDIS_EVERY
            nodes.append(Node(n, store, every, clock, stack))
        idle: dict[int, list[float]] = {n: [] for n in sizes}
        due: dict[int, list[float]] = {n: [] for n in sizes}
        for round_ in range(due_ticks):
            slot = _next_slot(nodes[0])
            # Each round starts with another size: the first tick after a wait is not favoured.
            nodes = nodes[1:] + nodes[:1] if round_ else nodes
            while len(idle[sizes[-1]]) < idle_ticks and _before(nodes[0], slot):
                for node in nodes:
                    idle[node.entries].append(node.idle())
            if nodes[0].clock is None:  # the server's clock: wait for the slot
                while nodes[0].store.now() < slot:
                    time.sleep(0.005)
            for node in nodes:
                due[node.entries].append(node.due(slot))
        for node in nodes:
            _check(node.due_sent, FEW * due_ticks, node.entries)
        return [
            Figures(
                node.entries,
                node.startup,
                node.traced,
                node.rss,
                statistics.median(idle[node.entries]),
                statistics.median(due[node.entries]),
            )
            for node in sorted(nodes, key=lambda node: node.entries)
        ]


def _next_slot(node: Node) -> datetime:
    """The next slot of the due entries (intervals are anchored at the UNIX epoch)."""
    now = node.store.now()
    every = node.every.total_seconds()
    return datetime.fromtimestamp((now.timestamp() // every + 1) * every, timezone.utc)


def _before(node: Node, slot: datetime) -> bool:
    """Whether an idle tick now still ends before ``slot`` (frozen clocks: always)."""
    return node.clock is not None or node.store.now() < slot - REDIS_MARGIN


def _timed(fn: Callable[[], object]) -> float:
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def _median(fn: Callable[[], object], n: int) -> float:
    return statistics.median(_timed(fn) for _ in range(n))


def _check(sent: int, expected: int, entries: int) -> None:
    """Each due tick published its slot's jobs, no more and no less (else the figure lies).

    More means a due tick found an earlier slot due too (the loop fell behind a slot).
    """
    if sent != expected:
        raise AssertionError(
            f"{entries:,} entries: {sent} published by the due ticks, not {expected}"
        )


def run(store: str, sizes: list[int], idle_ticks: int, due_ticks: int) -> list[Figures]:
    return measure(store, sizes, idle_ticks, due_ticks)


def table(store: str, rows: list[Figures]) -> list[str]:
    """The figures as lines of text, with the ratios of the largest size to the smallest."""
    head = (
        f"{'entries':>10}{'start-up':>12}{'traced/entry':>14}{'RSS/entry':>12}"
        f"{'idle tick':>14}{f'tick, {FEW} due':>14}"
    )
    lines = [f"beat with many entries on the {store} store", head]
    for r in rows:
        lines.append(
            f"{r.entries:>10,}{r.startup:>11.2f}s{r.traced_per_entry:>13,.0f}B"
            f"{r.rss_per_entry:>11,.0f}B{r.idle_tick * 1e6:>12,.0f}us{r.due_tick * 1e6:>12,.0f}us"
        )
    small, large = rows[0], rows[-1]
    lines.append(
        f"tick ratio {large.entries:,} / {small.entries:,} entries: "
        f"idle {large.idle_tick / small.idle_tick:.2f}x, "
        f"{FEW} due {large.due_tick / small.due_tick:.2f}x"
    )
    return lines
