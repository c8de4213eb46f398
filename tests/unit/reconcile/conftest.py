"""Fixtures of the reconciler's unit tests: a fresh world per test, and metrics counters reset."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_exactonce.observe import metrics
from tests.support.reconciler_world import World


@pytest.fixture(autouse=True)
def _counters() -> Iterator[None]:
    metrics.COUNTERS.reset()
    yield
    metrics.COUNTERS.reset()


@pytest.fixture
def world() -> World:
    return World()
