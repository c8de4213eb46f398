"""Delayed-job and reconciler benchmarks, each against its baseline in the same run.

* **sweep**: ``count`` due delayed jobs swept and dispatched by 1 and by 3
  beat nodes (separate processes, real ``ExactOnceScheduler`` ticks), in
  jobs/s and as a ratio against ``count`` plain ``apply_async`` calls on the
  same broker. Every job must end dispatched exactly once and every message
  must be on the broker, or the benchmark fails.
* **reconcile**: one reconciler pass over ``small`` and over ``large`` jobs of
  which 1,000 are stale: a pass costs O(stale), so the two should be close.

Both run on the Redis store and a Redis broker (``tests/services.py``).
"""

from __future__ import annotations

import logging
import multiprocessing
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import redis
from celery import Celery

from celery_exactonce import ExactOnceTask, runtime
from celery_exactonce.beat.scheduler import ExactOnceScheduler
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.dispatch.messages import GATED_OPTION
from celery_exactonce.reconcile.reconciler import Reconciler
from celery_exactonce.stores.redis.store import RedisStore
from tests import services
from tests.benchmarks.beat import BROKER_DB, drop_queue, plain_publish

TASK = "bench.t"
#: Stale jobs in the reconcile benchmark.
STALE = 1000


def _broker_url() -> str:
    return services.REDIS_URL.rsplit("/", 1)[0] + f"/{BROKER_DB}"


def _conf(namespace: str, queue: str, **extra: Any) -> dict[str, Any]:
    return {
        "broker_url": _broker_url(),
        "task_default_queue": queue,
        "task_ignore_result": True,
        "beat_schedule": {},
        "timezone": "UTC",
        "exactonce_store_url": services.REDIS_URL,
        "exactonce_namespace": namespace,
        "exactonce_tick_interval": 0.2,
        "exactonce_reconcile_interval": 3600,
        **extra,
    }


def _make_app(conf: dict[str, Any]) -> Celery:
    """The benchmark app; its gated task exists so that dispatch knows it (never run)."""
    app = Celery("bench-delayed", set_as_current=False)
    app.conf.update(conf)
    app.task(name=TASK, base=ExactOnceTask, shared=False)(_noop)
    return app


def _noop(i: int) -> None:
    """The benchmark task (only published)."""


@contextmanager
def _namespace(queue: str) -> Iterator[tuple[str, RedisStore]]:
    namespace = f"bench-{uuid.uuid4().hex[:12]}"
    app = _make_app(_conf(namespace, queue))
    store = runtime.runtime_for(app).store
    assert isinstance(store, RedisStore)
    try:
        yield namespace, store
    finally:
        store.drop_namespace()
        runtime.reset(app)
        drop_queue(queue)


def _create(store: RedisStore, news: list[NewJob]) -> None:
    for i in range(0, len(news), 1000):
        results = store.create_many(news[i : i + 1000])
        assert all(r.created for r in results)


def _beat_node(conf: dict[str, Any], start: Any, done: Any) -> None:
    """One beat node (a process): tick until two sweeps in a row find nothing due."""
    logging.getLogger("celery_exactonce").setLevel(logging.ERROR)
    app = _make_app(conf)
    scheduler = ExactOnceScheduler(app)
    runtime.runtime_for(app).store.now()  # connected before the clock starts
    done.put("ready")
    start.wait()
    idle = 0
    while idle < 2:
        store = runtime.runtime_for(app).store
        before = len(store.list_stale(State.PENDING, 0, 1))
        scheduler.tick()
        idle = idle + 1 if not before else 0
    done.put(True)


def sweep(count: int, nodes: int) -> float:
    """Seconds for ``nodes`` beat processes to sweep and dispatch ``count`` due delayed jobs."""
    queue = f"bench-sweep-{uuid.uuid4().hex}"
    with _namespace(queue) as (namespace, store):
        due = store.now() - timedelta(seconds=1)
        options = {GATED_OPTION: True}
        _create(
            store,
            [
                NewJob(
                    JobRef.submitted(f"d{i}"),
                    TASK,
                    State.PENDING,
                    node="bench",
                    args=[i],
                    options=options,
                    run_at=due + timedelta(microseconds=i),
                )
                for i in range(count)
            ],
        )
        context = multiprocessing.get_context("spawn")
        start, done = context.Event(), context.Queue()
        procs = [
            context.Process(target=_beat_node, args=(_conf(namespace, queue), start, done))
            for _ in range(nodes)
        ]
        for proc in procs:
            proc.start()
        for _ in procs:  # imported, scheduler built, store connected: not measured
            done.get(timeout=120)
        began = time.perf_counter()
        start.set()
        for _ in procs:
            done.get(timeout=3600)
        elapsed = time.perf_counter() - began
        for proc in procs:
            proc.join(60)
        dispatched = store.list_stale(State.DISPATCHED, 0, count + 1)
        landed = redis.Redis.from_url(_broker_url()).llen(queue)
        if (
            len(dispatched) != count
            or landed != count
            or any(j.dispatches != 1 for j in dispatched)
        ):
            raise AssertionError(
                f"sweep: {len(dispatched)} DISPATCHED, {landed} on the broker, of {count}"
            )
        return elapsed


def reconcile_pass(total: int, settle: float = 5.0) -> float:
    """Seconds of one pass over ``total`` RUNNING jobs of which :data:`STALE` are stale.

    The stale jobs are ``settle`` seconds older than the others; the running
    timeout falls halfway.
    """
    with _namespace(f"bench-rec-{uuid.uuid4().hex}") as (namespace, store):

        def running(prefix: str, n: int) -> list[NewJob]:
            return [
                NewJob(
                    JobRef.submitted(f"{prefix}{i}"),
                    TASK,
                    State.RUNNING,
                    node="bench",
                    run_id=uuid.uuid4().hex,
                )
                for i in range(n)
            ]

        _create(store, running("stale", STALE))
        time.sleep(settle)
        began = time.perf_counter()
        _create(store, running("fresh", total - STALE))
        creating = time.perf_counter() - began
        # Older than every fresh job, younger than every stale one.
        timeout = creating + settle / 2
        conf = _conf(
            namespace,
            "unused",
            exactonce_running_timeout=timeout,
            exactonce_heartbeat_interval=0.1,
            exactonce_max_skew=0,
        )
        app = _make_app(conf)
        try:
            reconciler = Reconciler(runtime.runtime_for(app))
            began = time.perf_counter()
            report = reconciler.run_pass()
            elapsed = time.perf_counter() - began
        finally:
            runtime.reset(app)
        if report.timed_out != STALE:
            raise AssertionError(f"reconcile: {report.timed_out} timed out, expected {STALE}")
        return elapsed


def run(
    count: int = 100_000, small: int = 10_000, large: int = 1_000_000, settle: float = 5.0
) -> list[tuple[str, str]]:
    logging.getLogger("celery_exactonce").setLevel(logging.ERROR)  # 1,000 timeouts
    plain = plain_publish(count)
    one, three = sweep(count, 1), sweep(count, 3)
    rec_small, rec_large = reconcile_pass(small, settle), reconcile_pass(large, settle)
    return [
        (f"plain apply_async x {count:,}", f"{plain:.1f} s ({count / plain:,.0f}/s)"),
        (f"sweep {count:,} due, 1 beat node", f"{one:.1f} s ({count / one:,.0f}/s)"),
        (f"sweep {count:,} due, 3 beat nodes", f"{three:.1f} s ({count / three:,.0f}/s)"),
        ("sweep / plain, 1 node", f"{one / plain:.2f}x"),
        ("sweep / plain, 3 nodes", f"{three / plain:.2f}x"),
        (f"reconcile pass, {small:,} jobs, {STALE:,} stale", f"{rec_small * 1e3:.0f} ms"),
        (f"reconcile pass, {large:,} jobs, {STALE:,} stale", f"{rec_large * 1e3:.0f} ms"),
        ("reconcile large / small", f"{rec_large / rec_small:.2f}x"),
    ]
