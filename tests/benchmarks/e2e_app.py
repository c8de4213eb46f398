"""The end-to-end benchmark's app, configured only from the environment.

``celery -A tests.benchmarks.e2e_app worker`` runs it (``e2e.py`` starts it);
the benchmark process builds the same app with :func:`make_app` to send. Its
two tasks have the same body, ``INCR`` of the key they are given in the
counter database (one round trip), so the benchmark counts the bodies that
ran the same way for all: :data:`PLAIN` is a plain Celery task, :data:`GATED`
an ``ExactOnceTask``, and :data:`ATOMIC` an ``ExactOnceTask`` with
``exactonce_atomic`` (on a SQL store: its gate, body and end in one
transaction; its body writes nothing to that database). Every other setting
is Celery's default (acks on receipt, a prefetch of 4 per process).

``EXACTONCE_BENCH_BROKER_URL``    broker
``EXACTONCE_BENCH_REDIS_PREFIX``  Redis ``global_keyprefix`` (unique per run)
``EXACTONCE_BENCH_STORE_URL``     ``exactonce_store_url``
``EXACTONCE_BENCH_NAMESPACE``     ``exactonce_namespace``
``EXACTONCE_BENCH_COUNTER_URL``   the Redis database the bodies count in
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import redis
from celery import Celery

from celery_exactonce import ExactOnceTask

PLAIN = "bench.e2e.plain"
GATED = "bench.e2e.gated"
ATOMIC = "bench.e2e.atomic"


#: The stores an atomic task runs on (a worker refuses one on another).
ATOMIC_SCHEMES = ("postgresql", "mysql", "sqlite", "django")


def make_app(env: Mapping[str, str] = os.environ, *, set_as_current: bool = True) -> Celery:
    """The benchmark app configured from ``env`` (``os.environ`` in the worker)."""
    app = Celery("bench-e2e", set_as_current=set_as_current)
    prefix = env.get("EXACTONCE_BENCH_REDIS_PREFIX")
    app.conf.update(
        broker_url=env.get("EXACTONCE_BENCH_BROKER_URL"),
        broker_transport_options={"global_keyprefix": prefix} if prefix else {},
        broker_connection_retry_on_startup=True,
        task_ignore_result=True,
        exactonce_store_url=env.get("EXACTONCE_BENCH_STORE_URL"),
        exactonce_namespace=env.get("EXACTONCE_BENCH_NAMESPACE", "default"),
    )
    counter_url = env.get("EXACTONCE_BENCH_COUNTER_URL", "")
    clients: list[redis.Redis] = []  # one per process, made in the pool child that runs bodies

    def count(key: str) -> None:
        if not clients:
            clients.append(redis.Redis.from_url(counter_url))
        clients[0].incr(key)

    app.task(name=PLAIN, shared=False)(count)
    app.task(name=GATED, base=ExactOnceTask, shared=False)(count)
    if (env.get("EXACTONCE_BENCH_STORE_URL") or "").split(":")[0] in ATOMIC_SCHEMES:
        app.task(name=ATOMIC, base=ExactOnceTask, shared=False, exactonce_atomic=True)(count)
    return app


#: The app ``celery -A tests.benchmarks.e2e_app worker`` runs.
app = make_app(os.environ)
