"""How the contract suite builds each store, and how it makes one lose its data."""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Callable
from typing import Any

from celery_exactonce.stores import InMemoryStore, store_from_url
from celery_exactonce.stores.base import StateStore
from tests import services

#: Opt-in (``EXACTONCE_TEST_SENTINEL=1``): the Redis store behind Sentinel with
#: ``min_replicas=1``, on a master, two replicas and three sentinels the contract
#: suite starts (once per test process). Off by default: it doubles the Redis
#: contract's time; tests/integration/test_sentinel*.py cover Sentinel in CI.
SENTINEL = ("sentinel",) if os.environ.get("EXACTONCE_TEST_SENTINEL") == "1" else ()
#: Where the suite's Sentinel group is (set by the fixture that starts it).
SENTINEL_URL_VARIABLE = "EXACTONCE_TEST_SENTINEL_URL"
#: Opt-in (``EXACTONCE_TEST_CLUSTER=1``): the Redis store on a Redis Cluster of
#: three masters with a replica each, which the contract suite starts (once per
#: test process), through a ``redis+cluster://`` URL: one slot per namespace
#: (``cluster``), and the namespace over ``CLUSTER_SHARDS`` slots (``cluster-shards``);
#: each again with ``min_replicas=1`` (``-replicas``: every counted write and
#: confirmed read waits for its master's replica).
CLUSTER = (
    ("cluster", "cluster-shards", "cluster-replicas", "cluster-shards-replicas")
    if os.environ.get("EXACTONCE_TEST_CLUSTER") == "1"
    else ()
)
#: ``exactonce_shards`` of the ``cluster-shards`` backend.
CLUSTER_SHARDS = 3
#: Where the suite's cluster is (set by the fixture that starts it).
CLUSTER_URL_VARIABLE = "EXACTONCE_TEST_CLUSTER_URL"

BACKENDS = (
    "memory",
    "redis",
    "postgres",
    "mysql",
    "sqlite",
    "django-sqlite",
    "django-postgres",
    *SENTINEL,
    *CLUSTER,
)

#: Backends reachable from several processes (the memory store lives in one).
SHARED_BACKENDS = ("redis", "postgres", "mysql", "sqlite")

#: The ``django://`` stores: the SQL store on a Django connection (the test settings'
#: ``store_sqlite`` and ``store_postgres`` aliases, :mod:`tests.django_tests.settings`).
DJANGO_BACKENDS = {"django-sqlite": "store_sqlite", "django-postgres": "store_postgres"}


def store_url(backend: str, tmpdir: str) -> str:
    """The store URL of ``backend`` for this test run."""
    if backend == "memory":
        return "memory://"
    if backend == "sqlite":
        return f"sqlite:///{os.path.join(tmpdir, 'exactonce.db')}"
    if backend in DJANGO_BACKENDS:
        return f"django://{DJANGO_BACKENDS[backend]}"
    if backend == "sentinel":
        return os.environ[SENTINEL_URL_VARIABLE]
    if backend in CLUSTER:
        return os.environ[CLUSTER_URL_VARIABLE]
    return services.SERVICE_URLS[backend]


def make_store(
    backend: str, url: str, namespace: str, retention: float = 3600.0, **extra: Any
) -> StateStore:
    """A set-up store of ``backend``; ``extra``: options every store takes (``compaction``)."""
    if backend == "memory":
        return InMemoryStore(namespace, retention=retention, **extra)
    if backend in DJANGO_BACKENDS:
        migrate_django_store(DJANGO_BACKENDS[backend])
    waits = backend == "sentinel" or backend.endswith("-replicas")
    options: dict[str, Any] = {"min_replicas": 1, **extra} if waits else dict(extra)
    if backend.startswith("cluster-shards"):
        options["shards"] = CLUSTER_SHARDS
    store = store_from_url(url, namespace=namespace, retention=retention, **options)
    store.setup()
    return store


def migrate_django_store(alias: str) -> None:
    """Django set up in this process (a spawned racer's too), and the store's tables on ``alias``.

    The tables are made as the app's migration makes them; the migration
    itself is tested with Django's own machinery (tests/django_tests).
    """
    import django
    from django.conf import settings

    if not settings.configured:
        from tests.django_tests.settings import in_process

        settings.configure(**in_process())
    django.setup()
    from celery_exactonce.contrib.django import tables
    from celery_exactonce.contrib.django.store import engine_for
    from celery_exactonce.stores.sql import schema as sql_schema

    sql_schema.create(engine_for(alias), sql_schema.build(tables.prefix()), f"django {alias}")


def discard(store: Any) -> None:
    """Drop what ``store`` holds of its namespace (where it can: not in memory), then close it."""
    try:
        drop = getattr(store, "drop_namespace", None)
        if drop is not None:
            drop()
    finally:
        store.close()


def lose_data(store: Any) -> None:
    """Make ``store`` forget everything of its namespace, as a restart without persistence would."""
    if isinstance(store, InMemoryStore):
        store.simulate_loss()
    else:
        store.drop_namespace()


class StoreFactory:
    """Builds stores of one backend, each in a fresh namespace unless told otherwise."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._tmp = tempfile.mkdtemp(prefix="exactonce-contract-")
        self.url = store_url(backend, self._tmp)
        if backend in DJANGO_BACKENDS:  # an app given ``url`` alone finds the tables made
            migrate_django_store(DJANGO_BACKENDS[backend])
        self.namespace = f"t{uuid.uuid4().hex[:12]}"
        self._made: list[StateStore] = []
        self._memory: dict[tuple[str, float, Any], StateStore] = {}

    def __call__(
        self, namespace: str | None = None, retention: float = 3600.0, **extra: Any
    ) -> StateStore:
        """A new client of the store; for memory, the one store of that namespace.

        ``extra``: options every store takes (``compaction``).
        """
        namespace = namespace or self.namespace
        if self.backend == "memory":
            key = (namespace, retention, tuple(sorted(extra.items())))
            if key not in self._memory:
                self._memory[key] = make_store("memory", self.url, namespace, retention, **extra)
            return self._memory[key]
        store = make_store(self.backend, self.url, namespace, retention, **extra)
        self._made.append(store)
        return store

    def cleanup(self) -> None:
        for store in self._made:
            try:
                if not isinstance(store, InMemoryStore):
                    store.drop_namespace()  # type: ignore[attr-defined]
            finally:
                store.close()


Factory = Callable[..., StateStore]
