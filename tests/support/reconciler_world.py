"""The frozen-clock world of the reconciler's unit tests (``tests/unit/reconcile/``).

One app, one InMemoryStore on a :class:`~celery_exactonce.testing.FrozenClock`
seen through a :class:`~tests.support.reconciling.HookedStore`, a fake broker
and a reconciler; the settings and per-task overrides every one of those tests
reads its thresholds from.

Faults are injected by wrapping the store's methods (:class:`HookedStore`); the
reconciler's own clock (grace, back-off) is a fake monotonic clock that moves
with the store's clock unless a test moves one alone.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from celery_exactonce.core import exceptions
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.reconcile import reconciler
from celery_exactonce.reconcile.reconciler import PassReport
from celery_exactonce.testing import FrozenClock, InMemoryStore
from tests.support.reconciling import (
    GATED,
    Broker,
    HookedStore,
    current,
    gate,
    make_app,
    put,
    reconciler_on,
    retry,
)

START = datetime(2026, 3, 1, 12, 0, 0, tzinfo=timezone.utc)
REPLAY_AGE = 60.0
DISPATCH_TIMEOUT = 300.0
DISPATCH_DEADLINE = 3600.0
RUNNING_TIMEOUT = 600.0
LEASE_TTL = 60.0

SETTINGS = {
    "exactonce_replay_age": REPLAY_AGE,
    "exactonce_dispatch_timeout": DISPATCH_TIMEOUT,
    "exactonce_dispatch_deadline": DISPATCH_DEADLINE,
    "exactonce_running_timeout": RUNNING_TIMEOUT,
    "exactonce_heartbeat_interval": 30.0,
    "exactonce_lease_ttl": LEASE_TTL,
}

#: Per-task overrides (task attributes), below and above the settings.
QUICK = "rec.quick"
QUICK_PLAIN = "rec.quick_plain"
SLOW = "rec.slow"
SLOW_PLAIN = "rec.slow_plain"
PLAIN_REDISPATCH = "rec.plain_redispatch"
TASKS: dict[str, dict[str, Any]] = {
    QUICK: {"exactonce_dispatch_deadline": 900, "exactonce_running_timeout": 120},
    QUICK_PLAIN: {"gated": False, "exactonce_dispatch_timeout": 120},
    SLOW: {"exactonce_dispatch_deadline": 7200, "exactonce_running_timeout": 1200},
    SLOW_PLAIN: {"gated": False, "exactonce_dispatch_timeout": 900},
    PLAIN_REDISPATCH: {"gated": False, "exactonce_redispatch": True},
}

MICROSECOND = 1e-6


class Monotonic:
    """The reconciler's own clock (grace period, back-off)."""

    def __init__(self) -> None:
        self.now = 10_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class World:
    """One app, one InMemoryStore on a FrozenClock (seen through a HookedStore), a fake broker
    and a reconciler."""

    def __init__(self, *, start: datetime = START, retention: float = 7 * 86_400.0) -> None:
        self.clock = FrozenClock(start)
        self.mono = Monotonic()
        self.store = InMemoryStore("recon", retention=retention, clock=self.clock)
        self.hooked = HookedStore(self.store)
        self.broker = Broker()
        self.app = make_app(SETTINGS, TASKS)
        self.reconciler = self.new_reconciler()

    def new_reconciler(self, node: str = "reconciler") -> reconciler.Reconciler:
        return reconciler_on(self.app, self.hooked, self.broker, node=node, monotonic=self.mono)  # type: ignore[arg-type]

    def advance(self, seconds: float) -> None:
        """Time passes for everyone: the store's clock and the reconciler's."""
        self.clock.advance(seconds)
        self.mono.advance(seconds)

    def run(self) -> PassReport:
        report = self.reconciler.run_pass()
        assert report.ran
        return report

    def put(self, state: State, task: str = GATED, **kwargs: Any) -> Job:
        return put(self.store, self.app, state, task, **kwargs)

    def get(self, job: Job) -> Job:
        return current(self.store, job)

    def state(self, job: Job) -> State:
        return self.get(job).state


def after_listing(world: World, state: State, act: Callable[[list[Job]], None]) -> None:
    """Run ``act`` on the jobs right after the reconciler listed the stale ones of ``state``."""

    def hook(result: list[Job], listed: State, *args: Any, **kwargs: Any) -> list[Job]:
        if State(listed) is state and result:
            act(result)
        return result

    world.hooked.after["list_stale"] = hook


def fail_writes_of(world: World, refs: set[JobRef]) -> None:
    """Every write to one of ``refs`` raises (poison jobs); the others go through."""

    def one(ref: JobRef, *args: Any, **kwargs: Any) -> None:
        if ref in refs:
            raise exceptions.StoreError(f"injected: {ref} cannot be written")

    def many(requests: list[tuple[JobRef, Any]], *args: Any, **kwargs: Any) -> None:
        if any(ref in refs for ref, _ in requests):
            raise exceptions.StoreError("injected: a poison job in the batch")

    world.hooked.before["transition"] = one
    world.hooked.before["transition_many"] = many


def retried(world: World, task: str, retries: int) -> Job:
    """A job that ran and was retried ``retries`` times; its last attempt DISPATCHED."""
    job = world.put(State.RUNNING, task)
    for n in range(retries):
        job = retry(world.store, job)
        if n + 1 < retries:
            job = gate(world.store, job)
    return job
