"""What the reconciler tests share: an app with tasks, a fake broker, jobs put in a state, and a
store proxy that injects faults or lets a 'worker' act at a chosen moment.

Used by ``tests/unit/reconcile/`` (InMemoryStore + FrozenClock, through
:mod:`tests.support.reconciler_world`) and
``tests/contract/test_reconciler.py`` (every backend, real time).
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from celery import Celery

from celery_exactonce import runtime
from celery_exactonce.core import exceptions
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.dispatch.dispatcher import Dispatcher
from celery_exactonce.dispatch.messages import GATED_OPTION, HEADER_ATTEMPT
from celery_exactonce.dispatch.publisher import PublishFailed
from celery_exactonce.reconcile.reconciler import Reconciler
from celery_exactonce.stores.base import StateStore, partitions_of
from celery_exactonce.task.base import ExactOnceTask
from celery_exactonce.task.gate import validate_gated_task

NODE = "test-node"

#: Tasks every test app has. ``GATED`` and its kin are ExactOnceTasks (their
#: jobs carry the gated option); ``PLAIN`` is a plain Celery task.
GATED = "rec.gated"
REDISPATCH = "rec.redispatch"
RERUN = "rec.rerun"
PLAIN = "rec.plain"

Hook = Callable[..., Any]

#: Timeouts of a fraction of a second, for tests in real (store) time (the contract
#: suite's, and the sharded store's in tests/unit/reconcile/test_partitions.py).
REPLAY_AGE = 0.08
DISPATCH_TIMEOUT = 0.3
DISPATCH_DEADLINE = 0.6
#: Twelve heartbeat intervals: a live job's heartbeat thread may stall on a loaded machine.
RUNNING_TIMEOUT = 0.6

#: Small timeouts that still pass the start-up checks (docs/reference/settings.md)
#: (replay_age >= 2 x (tick_interval + publish_timeout + store_timeout) = 0.05 s).
QUICK_SETTINGS: dict[str, Any] = {
    "exactonce_tick_interval": 0.005,
    "exactonce_publish_timeout": 0.01,
    "exactonce_store_timeout": 0.01,
    "exactonce_replay_age": REPLAY_AGE,
    "exactonce_dispatch_timeout": DISPATCH_TIMEOUT,
    "exactonce_dispatch_deadline": DISPATCH_DEADLINE,
    "exactonce_running_timeout": RUNNING_TIMEOUT,
    "exactonce_heartbeat_interval": 0.05,
    "exactonce_max_skew": 0.0,
    "exactonce_window_lookback": 1.0,
    "exactonce_lease_ttl": 5.0,
}

#: The live state a job passes through on its way to each terminal state.
TERMINAL_VIA = {
    State.SUCCEEDED: State.RUNNING,
    State.FAILED: State.RUNNING,
    State.TIMEOUT: State.DISPATCHED,
    State.PUBLISHED: State.DISPATCHED,
    State.CANCELLED: State.SCHEDULED,
}


class Broker:
    """A fake publisher: records ``(job id, attempt)`` of every message; fails when told."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sent: list[tuple[str, int]] = []
        self.fault: PublishFailed | None = None
        self.tries = 0

    def __call__(self, job: Job, headers: Mapping[str, Any], extra: Mapping[str, Any]) -> None:
        with self._lock:
            self.tries += 1
            if self.fault is not None:
                raise self.fault
            self.sent.append((job.ref.id, int(headers[HEADER_ATTEMPT])))

    def count(self) -> Counter[tuple[str, int]]:
        with self._lock:
            return Counter(self.sent)

    def ids(self) -> list[str]:
        with self._lock:
            return [job_id for job_id, _ in self.sent]


def make_app(
    settings: Mapping[str, Any], tasks: Mapping[str, Mapping[str, Any]] | None = None
) -> Celery:
    """A Celery app with ``exactonce_*`` ``settings``, the shared tasks and ``tasks``.

    ``tasks`` maps a task name to its attributes; ``gated=False`` in them
    makes a plain Celery task, anything else an ExactOnceTask. The settings and
    every task's timeouts must pass the start-up checks (docs/reference/settings.md).
    """
    app = Celery("reconciler-tests", set_as_current=False)
    app.conf.update(exactonce_store_url="memory://", **settings)
    declared: dict[str, dict[str, Any]] = {
        GATED: {},
        REDISPATCH: {"exactonce_redispatch": True},
        RERUN: {"exactonce_rerun": True},
        PLAIN: {"gated": False},
        **{name: dict(attrs) for name, attrs in (tasks or {}).items()},
    }
    for name, attrs in declared.items():
        gated = attrs.pop("gated", True)
        base = {"base": ExactOnceTask} if gated else {}

        def body(*args: Any, **kwargs: Any) -> None:
            return None

        app.task(name=name, shared=False, **base, **attrs)(body)
    check_timeouts(app)
    return app


def check_timeouts(app: Celery) -> None:
    """Refuse a test app whose settings or per-task timeouts a worker would refuse.

    Gated tasks go through the worker's own check. Of a plain task the reconciler
    reads only ``dispatch_timeout``, held to the same rule (``> replay_age``).
    """
    config = runtime.config_for(app)
    for task in app.tasks.values():
        if isinstance(task, ExactOnceTask):
            validate_gated_task(task)
            continue
        timeout = getattr(task, "exactonce_dispatch_timeout", None)
        assert timeout is None or timeout > config.replay_age, (task.name, timeout)


def is_gated(app: Celery, task: str) -> bool:
    return isinstance(app.tasks[task], ExactOnceTask)


def reconciler_on(
    app: Celery,
    store: StateStore,
    broker: Broker,
    *,
    node: str = "reconciler",
    monotonic: Callable[[], float] = time.monotonic,
) -> Reconciler:
    """A reconciler of ``app`` on ``store`` (one client), publishing to ``broker``."""
    rt = runtime.install(app, store)
    rt.node = node
    rt.dispatcher = Dispatcher(store, broker, node=node)
    return Reconciler(rt, tasks=app.tasks, monotonic=monotonic)


def put(
    store: StateStore,
    app: Celery,
    state: State,
    task: str = GATED,
    *,
    deadline: datetime | None = None,
    job_id: str | None = None,
    args: list[Any] | None = None,
) -> Job:
    """A job of ``task`` brought to ``state`` the way the dispatch path and the gate would."""
    new = NewJob(
        JobRef.submitted(job_id or uuid.uuid4().hex),
        task,
        State.SCHEDULED,
        node=NODE,
        args=[1] if args is None else args,
        deadline=deadline,
        options={GATED_OPTION: is_gated(app, task), "queue": "celery"},
    )
    created = store.create(new)
    assert created.created and created.job is not None
    job = created.job
    via = TERMINAL_VIA.get(state, state)
    if via in (State.DISPATCHED, State.RUNNING):
        job = move(store, job, State.DISPATCHED, reason="dispatch")
    if via is State.RUNNING:
        job = gate(store, job)
    if state.terminal:
        guard = {"run_id": job.run_id} if job.state is State.RUNNING else {}
        job = move(store, job, state, reason="done", **guard)
    return job


def move(store: StateStore, job: Job, to: State, *, reason: str = "test", **guards: Any) -> Job:
    """CAS ``job`` (on its rev) to ``to``; the test fails if it does not apply."""
    request = Transition(
        to, frozenset({job.state}), node=NODE, reason=reason, rev=job.rev, **guards
    )
    result = store.transition(job.ref, request)
    assert result.applied and result.job is not None, (job.ref, to, result.status)
    return result.job


def gate(store: StateStore, job: Job) -> Job:
    """What a worker's gate does with a delivery of ``job``'s current attempt."""
    request = Transition(
        State.RUNNING,
        frozenset({State.SCHEDULED, State.DISPATCHED}),
        node="worker",
        reason="gate",
        attempt=job.attempt,
        new_run_id=uuid.uuid4().hex,
    )
    result = store.transition(job.ref, request)
    assert result.applied and result.job is not None, (job.ref, result.status)
    return result.job


def retry(store: StateStore, job: Job) -> Job:
    """A Celery retry of a RUNNING job: the next attempt, written DISPATCHED before its publish."""
    request = Transition(
        State.DISPATCHED,
        frozenset({State.RUNNING}),
        node="worker",
        reason="retry",
        run_id=job.run_id,
        next_attempt=True,
    )
    result = store.transition(job.ref, request)
    assert result.applied and result.job is not None
    return result.job


def current(store: StateStore, job: Job) -> Job:
    found = store.get(job.ref)
    assert found is not None, job.ref
    return found


def entries(job: Job, *, src: State | None = None, dst: State | None = None) -> list[Any]:
    """The history entries of ``job`` from ``src`` and/or to ``dst``."""
    return [
        h for h in job.history if (src is None or h.src is src) and (dst is None or h.dst is dst)
    ]


class HookedStore:
    """A store client that runs hooks around chosen methods, and counts every call.

    ``before[name](*args, **kwargs)`` runs first and may raise (a fault);
    ``after[name](result, *args, **kwargs)`` runs on the result and returns
    what the caller gets (or raises: a write that applied but whose answer
    was lost). Everything else is delegated to the wrapped store.
    """

    def __init__(self, inner: StateStore, *, shares: HookedStore | None = None) -> None:
        self.inner = inner
        self.before: dict[str, Hook] = {}
        self.after: dict[str, Hook] = {}
        self.calls: Counter[str] = Counter()
        self.down = False
        """While set, every call raises StoreUnavailable (a store outage)."""
        self._lock = threading.Lock()
        #: Whose hooks, counts and outage switch these are (a partition's view: its store's).
        self._root = self
        if shares is not None:
            self._root = shares
            self.before, self.after, self.calls = shares.before, shares.after, shares.calls
            self._lock = shares._lock

    def partitions(self) -> list[Any]:
        """The wrapped store's partitions, each seen through this store's hooks and counts."""
        parts = partitions_of(self.inner)
        if len(parts) == 1 and parts[0] is self.inner:
            return [self]
        return [HookedStore(part, shares=self) for part in parts]

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.calls[name] += 1
            if self._root.down:
                raise exceptions.StoreUnavailable(f"injected outage ({name})")
            hook = self.before.get(name)
            if hook is not None:
                hook(*args, **kwargs)
            result = attr(*args, **kwargs)
            post = self.after.get(name)
            return result if post is None else post(result, *args, **kwargs)

        return call

    @property
    def namespace(self) -> str:
        return self.inner.namespace

    @property
    def retention(self) -> float:
        return self.inner.retention


def flaky_writes(hooked: HookedStore, rate: float, seed: int) -> Callable[[], None]:
    """Make ``rate`` of the store's writes fail, half before and half after applying.

    Returns a function that ends the faults.
    """
    rng = random.Random(seed)
    lock = threading.Lock()
    writes = (
        "transition",
        "transition_many",
        "acquire_lease",
        "renew_lease",
        "release_lease",
        "purge_expired",
    )

    def roll() -> float:
        with lock:
            return rng.random()

    def before(*args: Any, **kwargs: Any) -> None:
        if roll() < rate / 2:
            raise exceptions.StoreUnavailable("injected: write refused")

    def after(result: Any, *args: Any, **kwargs: Any) -> Any:
        if roll() < rate / 2:
            raise exceptions.StoreUnavailable("injected: write applied, answer lost")
        return result

    for name in writes:
        hooked.before[name] = before
        hooked.after[name] = after

    def stop() -> None:
        for name in writes:
            hooked.before.pop(name, None)
            hooked.after.pop(name, None)

    return stop
