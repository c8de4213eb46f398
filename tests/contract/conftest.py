from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_exactonce.stores.base import StateStore
from tests import services
from tests.support.backends import BACKENDS, DJANGO_BACKENDS, StoreFactory


def _need(backend: str) -> None:
    if backend in ("redis", "postgres", "mysql"):
        services.need(backend)
    if backend == "django-postgres":
        services.need("postgres")


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    _need(request.param)
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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/contract/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.contract)
