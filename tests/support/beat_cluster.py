"""A beat cluster for unit tests: N ExactOnceScheduler nodes on one InMemoryStore.

Shared by ``test_scheduler.py`` and ``test_scheduler_calendar.py``. Every node
ticks on the same :class:`FrozenClock` (the store's clock, which is the one beat
judges due-ness on), and publishes to one fake :class:`Broker`, so a test can
count what the whole cluster dispatched.
"""

from __future__ import annotations

import contextlib
import heapq
import re
import signal
from collections.abc import Iterator, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery

from celery_exactonce import ConfigurationError, ExactOnceTask, runtime
from celery_exactonce.beat.scheduler import ExactOnceScheduler
from celery_exactonce.core.jobs import Job
from celery_exactonce.dispatch.dispatcher import Dispatcher
from celery_exactonce.observe import metrics
from celery_exactonce.startup import StartupRefused
from celery_exactonce.testing import FrozenClock, InMemoryStore

START = datetime(2026, 6, 1, 12, 0, 0, tzinfo=timezone.utc)

#: The store retention the cluster uses unless told (the config's default).
STORE_RETENTION = 7 * 86_400


class Broker:
    """Records every job handed to it, whichever node published it."""

    def __init__(self) -> None:
        self.sent: list[Job] = []

    def __call__(self, job: Job, headers: Mapping[str, Any], extra: Mapping[str, Any]) -> None:
        self.sent.append(job)


class Cluster:
    """N beat nodes (schedulers) of one app sharing one store, and a fake broker.

    ``start`` is the store time of the first tick; the store was born a day
    before it unless ``store_born`` says otherwise (so its first slots are
    provable). ``conf`` holds Celery settings (``exactonce_*``, ``timezone``).

    The nodes import the entries' tasks, as plain tasks, unless ``imported`` is
    false (a slim beat) or an entry declares ``gated`` (it stands for a task
    beat does not import); the tasks named in ``gated`` are gated
    (``exactonce_running_timeout = 1200``, ``exactonce_redispatch = True``).
    """

    def __init__(
        self,
        schedule: dict[str, Any],
        nodes: int = 3,
        *,
        start: datetime = START,
        store_born: datetime | None = None,
        store_retention: float = STORE_RETENTION,
        imported: bool = True,
        gated: tuple[str, ...] = (),
        **conf: Any,
    ) -> None:
        self.imported, self.gated = imported, gated
        self.clock = FrozenClock(store_born or start - timedelta(days=1))
        self.store = InMemoryStore("beat", retention=store_retention, clock=self.clock)
        self.store.epoch()
        self.clock.set(start)
        self.broker = Broker()
        self.app = self.new_app(schedule, **conf)
        self.nodes = [ExactOnceScheduler(self.app) for _ in range(nodes)]

    def new_app(self, schedule: dict[str, Any], **conf: Any) -> Celery:
        """A Celery app with its own settings, on this cluster's store and broker."""
        app = Celery("beat-tests", set_as_current=False)
        settings: dict[str, Any] = {"timezone": "UTC", **conf}
        app.conf.update(exactonce_store_url="memory://", beat_schedule=schedule, **settings)
        for name in self.gated:
            app.task(
                name=name,
                base=ExactOnceTask,
                shared=False,
                exactonce_redispatch=True,
                exactonce_running_timeout=1200,
            )(_noop)
        if self.imported:
            register_plain_tasks(app, schedule)
        rt = runtime.install(app, self.store)
        rt.dispatcher = Dispatcher(self.store, self.broker, node="beat")
        return app

    def add_node(self, schedule: dict[str, Any], **conf: Any) -> ExactOnceScheduler:
        """One more node, of an app of its own (own schedule and settings), same store."""
        node = ExactOnceScheduler(self.new_app(schedule, **conf))
        self.nodes.append(node)
        return node

    def tick_all(self) -> None:
        for node in self.nodes:
            node.tick()

    def run(self, seconds: float, step: float = 1.0) -> None:
        for _ in range(int(seconds / step)):
            self.clock.advance(step)
            self.tick_all()

    def run_until(self, end: datetime, step: float, *, rotate: bool = False) -> None:
        """Step the clock by ``step`` seconds, ticking every node, while it is before ``end``.

        With ``rotate``, the node that ticks first changes at every step, so
        every node wins some claims (and loses others) with its own state.
        """
        first = 0
        while self.clock.now() < end:
            self.clock.advance(step)
            order = self.nodes[first:] + self.nodes[:first] if rotate else self.nodes
            for node in order:
                node.tick()
            first = (first + 1) % len(self.nodes)

    def run_as_beat(self, seconds: float, max_ticks: int = 100_000) -> int:
        """Let each node tick when the sleep its previous tick returned is over.

        This is Celery's beat loop (``sleep(tick())``) on the frozen clock, every
        node on its own cadence; returns the number of ticks (bounded).
        """
        end = self.clock.now() + timedelta(seconds=seconds)
        wake = [(self.clock.now(), i) for i in range(len(self.nodes))]
        heapq.heapify(wake)
        ticks = 0
        while wake and wake[0][0] <= end:
            at, i = heapq.heappop(wake)
            self.clock.set(at)
            sleep = self.nodes[i].tick()
            ticks += 1
            assert ticks <= max_ticks, "beat loop did not advance"
            heapq.heappush(wake, (at + timedelta(seconds=sleep), i))
        self.clock.set(end)
        return ticks

    def fired(self, entry: str) -> list[datetime]:
        """The fire times of the occurrences of ``entry`` the broker received, sorted."""
        return sorted(job.fire_time for job in self.broker.sent if job.entry == entry)  # type: ignore[misc]


@contextlib.contextmanager
def isolated() -> Iterator[None]:
    """Fresh counters, and the SIGTERM handler restored (schedulers install their own)."""
    metrics.COUNTERS.reset()
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, sigterm)


@contextlib.contextmanager
def refused_at_start(match: str = "") -> Iterator[list[ConfigurationError]]:
    """Expect beat to refuse to start (``StartupRefused``) on a ``ConfigurationError``.

    Yields a list that holds the error afterwards; ``match`` is searched in its text.
    """
    holder: list[ConfigurationError] = []
    with pytest.raises(StartupRefused) as raised:
        yield holder
    error = raised.value.error
    assert isinstance(error, ConfigurationError), error
    assert re.search(match, str(error)), str(error)
    holder.append(error)


def register_plain_tasks(app: Celery, schedule: dict[str, Any]) -> None:
    """Register the entries' tasks as plain tasks, as a beat importing their module would.

    An entry that declares ``gated`` stands for a task beat does not import: skipped.
    """
    for entry in schedule.values():
        name = entry.get("task") if isinstance(entry, dict) else None
        declared = "gated" in ((entry.get("options") or {}).get("exactonce") or {})
        if name and name not in app.tasks and not declared:
            app.task(name=name, shared=False)(_noop)


def _noop(*_args: Any, **_kwargs: Any) -> None:
    """The body of the plain tasks beat tests schedule (beat never runs it)."""


def every(seconds: float, task: str = "plain.t", **options: Any) -> dict[str, Any]:
    """A beat entry on a ``timedelta`` schedule; ``options`` become the entry's options."""
    return {"task": task, "schedule": timedelta(seconds=seconds), "options": options}
