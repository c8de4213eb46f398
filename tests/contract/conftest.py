from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from celery_exactonce.stores.base import StateStore
from tests import services
from tests.support.backends import (
    BACKENDS,
    CLUSTER,
    CLUSTER_URL_VARIABLE,
    DJANGO_BACKENDS,
    SENTINEL_URL_VARIABLE,
    StoreFactory,
)


@pytest.fixture(scope="session")
def sentinel_url() -> Iterator[str]:
    """A master, two replicas and three sentinels for this test process (opt-in backend)."""
    from tests.integration.redis_server import sentinel_group

    with sentinel_group(replicas=2, sentinels=3) as group:
        os.environ[SENTINEL_URL_VARIABLE] = group.url()  # spawned racers inherit it
        try:
            yield group.url()
        finally:
            os.environ.pop(SENTINEL_URL_VARIABLE, None)


@pytest.fixture(scope="session")
def cluster_url() -> Iterator[str]:
    """A Redis Cluster of three masters, a replica each, for this test process (opt-in backend)."""
    from tests.integration.redis_server import cluster

    with cluster(masters=3, replicas_per_master=1) as group:
        os.environ[CLUSTER_URL_VARIABLE] = group.url()  # spawned racers inherit it
        try:
            yield group.url()
        finally:
            os.environ.pop(CLUSTER_URL_VARIABLE, None)


def _need(backend: str) -> None:
    if backend in ("redis", "postgres", "mysql"):
        services.need(backend)
    if backend == "django-postgres":
        services.need("postgres")


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    _need(request.param)
    if request.param == "sentinel":
        request.getfixturevalue("sentinel_url")
    if request.param in CLUSTER:
        request.getfixturevalue("cluster_url")
    if request.param in DJANGO_BACKENDS:  # pytest-django blocks the ORM's connections
        blocker = request.getfixturevalue("django_db_blocker")
        blocker.unblock()
        request.addfinalizer(blocker.restore)
    return str(request.param)


@pytest.fixture
def store_factory(backend: str) -> Iterator[StoreFactory]:
    factory = StoreFactory(backend)
    yield factory
    factory.cleanup()


@pytest.fixture
def store(store_factory: StoreFactory) -> StateStore:
    return store_factory()


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the slow marks added here count
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/contract/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.contract)
        slow_backends = item.get_closest_marker("slow_backends")
        callspec = getattr(item, "callspec", None)
        if slow_backends and callspec and callspec.params.get("backend") in slow_backends.args:
            item.add_marker(pytest.mark.slow)
