"""Submit benchmarks: ``.delay()`` of a gated task against the same task as a plain Celery task.

One process calls ``.delay(i)`` ``count`` times on a plain task, then ``count``
times on the same function as a gated task (``base=ExactOnceTask``: each call
creates the job in the store, CASes it ``DISPATCHED`` and publishes it), in
alternating rounds (``tests/benchmarks/rounds.py``). Per store (Redis,
PostgreSQL, MariaDB, SQLite: the URLs of ``tests/support/backends.py``; and
the ``django://`` store on PostgreSQL, through the tests' Django settings) and
per broker: Redis, and RabbitMQ with publisher confirms (``confirm_publish``,
which a gated app must set on AMQP). Both tasks belong to one app, so the
plain one publishes with the same broker settings, confirms included. The
figures are calls/s of one client; the Redis store on a Redis broker is the
main one.

Plain and gated publish to queues of their own, fresh for the run. Every
round's messages are counted on the broker (then purged), so a round that
submitted less fails; one unmeasured call per task first opens the
connections. Queues and the store namespace (the SQLite file) are removed
afterwards.

:func:`write_floor` measures, in the same run, what one store write costs on
the store's own server and driver: a one-row ``INSERT`` of a record's size and
its commit in a scratch table (on the Redis store: one ``SET``, a round trip).
Against plain's time per call it says how near the physics a gated submit
could come if it cost plain's work plus that write and nothing else. The
*floor* rounds measure that: between each pair's plain and gated rounds, the
plain task's calls, each after one such write, so that what the write costs
beside a publish (waking the store's server, caches, a broker's confirm after
a longer gap) is in the figure, not only its time alone.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from celery import Celery, Task
from kombu.exceptions import ChannelError

from celery_exactonce import ExactOnceTask, runtime
from tests import services
from tests.benchmarks.beat import BROKER_DB
from tests.benchmarks.rounds import Rounds, alternate
from tests.support.backends import DJANGO_BACKENDS, SHARED_BACKENDS, store_url

#: Writes a floor measure times, in each of its batches (the median batch counts).
FLOOR_WRITES = 500
FLOOR_BATCHES = 3
#: The size of the value a floor write writes: about a submitted job's record.
RECORD_BYTES = 1000

#: Stores a gated app can run on (the in-process memory store is no deployment), and the
#: ``django://`` store on PostgreSQL.
STORES = (*SHARED_BACKENDS, "django-postgres")
#: Brokers, each with the ``tests.services`` service it needs.
BROKERS = ("redis", "rabbitmq")


def broker_url(broker: str) -> str:
    """The benchmarks' Redis database, or RabbitMQ's default vhost."""
    if broker == "redis":
        return services.REDIS_URL.rsplit("/", 1)[0] + f"/{BROKER_DB}"
    if broker == "rabbitmq":
        return services.AMQP_URL
    raise ValueError(f"unknown broker {broker!r}")


def transport_options(broker: str) -> dict[str, Any]:
    """Publisher confirms on RabbitMQ: a gated app without them refuses to start."""
    return {"confirm_publish": True} if broker == "rabbitmq" else {}


def service_of(name: str) -> str | None:
    """The ``tests.services`` service a store or broker needs (SQLite: none, a file)."""
    if name == "sqlite":
        return None
    return "postgres" if name == "django-postgres" else name


def _django(store: str, tmp: str) -> None:
    """Django set up in this process with the tests' settings, the store's tables made."""
    from tests.django_tests.settings import STORE_SQLITE
    from tests.support.backends import migrate_django_store

    os.environ.setdefault(STORE_SQLITE, os.path.join(tmp, "django-store.sqlite3"))
    migrate_django_store(DJANGO_BACKENDS[store])


def _noop(i: int) -> None:
    """The benchmark task (only published, never run)."""


@dataclass(frozen=True)
class Bench:
    """One app with the same function as a plain and as a gated task, each on its own queue."""

    app: Celery
    plain: Task
    gated: Task
    #: In the name of every queue (and so of every broker key) of this bench.
    uid: str

    def landed(self, queue: str) -> int:
        """Messages waiting in ``queue`` on the broker."""
        with self.app.connection_for_write() as conn:
            try:
                return int(conn.default_channel.queue_declare(queue=queue, passive=True)[1])
            except ChannelError:  # never declared (Redis: no message ever landed on it)
                return 0

    def settle(self, queue: str, expected: int, what: str) -> None:
        """Fail unless ``expected`` messages are in ``queue``; then empty it."""
        landed = self.landed(queue)
        if landed != expected:
            raise AssertionError(f"{what}: {landed} of {expected} messages on the broker")
        with self.app.connection_for_write() as conn:
            conn.default_channel.queue_purge(queue)

    def drop_queues(self) -> None:
        """Remove the queues and their exchanges (on Redis: every key naming the bench)."""
        if self.app.conf.broker_url.startswith("redis"):
            # kombu's Redis queue_delete forgets only bindings this connection made.
            services.delete_redis_keys(self.app.conf.broker_url, f"*{self.uid}*")
            return
        with self.app.connection_for_write() as conn:
            for task in (self.plain, self.gated):
                conn.default_channel.queue_delete(task.queue)
                conn.default_channel.exchange_delete(task.queue)


@contextmanager
def bench_app(store: str, broker: str, name: str = "bench") -> Iterator[Bench]:
    """:class:`Bench` on ``store`` and ``broker``, a fresh namespace and queues, cleaned up after.

    The store is opened and set up (schema, checks) before it is handed out.
    """
    uid = uuid.uuid4().hex[:12]
    tmp = tempfile.mkdtemp(prefix="exactonce-bench-")
    if store in DJANGO_BACKENDS:
        _django(store, tmp)
    app = Celery(name, set_as_current=False)
    app.conf.update(
        broker_url=broker_url(broker),
        broker_transport_options=transport_options(broker),
        task_ignore_result=True,
        timezone="UTC",
        exactonce_store_url=store_url(store, tmp),
        exactonce_namespace=f"bench-{uid}",
    )
    plain = app.task(name=f"{name}.plain", shared=False, queue=f"{name}-plain-{uid}")(_noop)
    gated = app.task(
        name=f"{name}.gated", base=ExactOnceTask, shared=False, queue=f"{name}-gated-{uid}"
    )(_noop)
    bench = Bench(app, plain, gated, uid)
    try:
        store_client = runtime.runtime_for(app).store
        try:
            yield bench
        finally:
            try:
                store_client.drop_namespace()  # type: ignore[attr-defined]
            finally:
                bench.drop_queues()
    finally:
        runtime.reset(app)
        app.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _timed(
    bench: Bench,
    task: Task,
    count: int,
    what: str,
    before: Callable[[], Any] | None = None,
) -> float:
    """Seconds for ``count`` calls of ``task.delay`` (each after ``before()``, if given);
    every message must be on the broker."""
    call: Callable[..., Any] = task.delay
    start = time.perf_counter()
    if before is None:
        for i in range(count):
            call(i)
    else:
        for i in range(count):
            before()
            call(i)
    elapsed = time.perf_counter() - start
    bench.settle(task.queue, count, what)
    return elapsed


def measure(store: str, broker: str, count: int, rounds: int) -> Rounds:
    """``rounds`` pairs of ``count`` plain and ``count`` gated ``.delay()`` calls, and
    between them the floor: ``count`` plain calls, each after one :func:`store_writer` write."""
    with bench_app(store, broker) as bench, store_writer(store) as write:
        for task in (bench.plain, bench.gated):  # connections opened, queues declared
            task.delay(-1)
            bench.settle(task.queue, 1, f"submit warm-up ({task.name})")
        write()
        where = f"{store} store, {broker} broker"
        return alternate(
            rounds,
            count,
            lambda: _timed(bench, bench.plain, count, f"submit plain, {where}"),
            lambda: _timed(bench, bench.gated, count, f"submit gated, {where}"),
            lambda: _timed(bench, bench.plain, count, f"submit floor, {where}", before=write),
        )


def write_floor(store: str, writes: int = FLOOR_WRITES) -> float:
    """Seconds one write and its commit take on ``store``'s server, by its driver (median batch).

    The write of :func:`store_writer`, in tight batches: the server and the
    driver warm, nothing else between the writes.
    """
    with store_writer(store) as write:
        return _batches(writes, write)


@contextmanager
def store_writer(store: str) -> Iterator[Callable[[], Any]]:
    """``write()``: one write of a record's size to ``store``'s server, by its driver
    (on SQL, a row of its own each time).

    SQL: a one-row ``INSERT`` into a scratch table, in autocommit, on a
    connection of the store's own engine (its settings and listeners); the
    ``django://`` store on PostgreSQL writes to PostgreSQL. Redis: one ``SET``
    of :data:`RECORD_BYTES` on the store's server, a round trip. The table
    and the key go afterwards.
    """
    run = uuid.uuid4().hex
    if store == "redis":
        import redis

        client = redis.Redis.from_url(services.REDIS_URL)
        key, value = f"exactonce-floor-{run}", "x" * RECORD_BYTES
        try:
            yield lambda: client.set(key, value)
        finally:
            client.delete(key)
            client.close()
        return
    from celery_exactonce.stores import store_from_url

    tmp = tempfile.mkdtemp(prefix="exactonce-floor-")
    url = store_url("postgres" if store == "django-postgres" else store, tmp)
    table = f"exactonce_floor_{run[:12]}"
    sql_store = store_from_url(url, namespace="floor")  # its engine, never set up
    raw = sql_store.engine.raw_connection()  # type: ignore[attr-defined]
    try:
        driver = raw.driver_connection
        marker = "?" if store == "sqlite" else "%s"
        cursor = driver.cursor()  # type: ignore[union-attr]
        cursor.execute(f"CREATE TABLE {table} (id VARCHAR(64) PRIMARY KEY, v TEXT)")
        driver.commit()  # type: ignore[union-attr]
        _autocommit(driver)
        insert = f"INSERT INTO {table} (id, v) VALUES ({marker}, {marker})"
        value, ids = "x" * RECORD_BYTES, itertools.count()
        try:
            yield lambda: cursor.execute(insert, (f"{run}-{next(ids)}", value))
        finally:
            cursor.execute(f"DROP TABLE {table}")
            cursor.close()
    finally:
        raw.close()
        sql_store.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _autocommit(driver: Any) -> None:
    """Each statement its own transaction, committed by the server as it answers."""
    if callable(getattr(driver, "autocommit", None)):  # PyMySQL
        driver.autocommit(True)
    elif hasattr(driver, "isolation_level") and not hasattr(driver, "pgconn"):  # sqlite3
        driver.isolation_level = None
    else:  # psycopg
        driver.autocommit = True


def _batches(writes: int, write: Callable[[], Any]) -> float:
    """Seconds per call of ``write``: the median of :data:`FLOOR_BATCHES` timed batches."""
    per_write = []
    for _ in range(FLOOR_BATCHES):
        start = time.perf_counter()
        for _ in range(writes):
            write()
        per_write.append((time.perf_counter() - start) / writes)
    return sorted(per_write)[len(per_write) // 2]
