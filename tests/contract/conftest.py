from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_exactonce.stores.base import StateStore
from tests import services
from tests.support.backends import BACKENDS, StoreFactory


def _need(backend: str) -> None:
    if backend in ("redis", "postgres", "mysql"):
        services.need(backend)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    _need(request.param)
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
