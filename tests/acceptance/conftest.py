"""Fixtures of the acceptance tests: a ``deployment`` per (broker, store) pair.

``deployment`` is parametrised over :data:`harness.MATRIX`; a test narrows it with
``@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis",))``.
Every test here is marked ``acceptance`` and gets a 180 s timeout.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import services
from tests.acceptance.harness import MATRIX, SERVICE_OF, Deployment, Ledger, gate_available

TEST_TIMEOUT = 180


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "acceptance: real celery worker processes on real brokers and stores"
    )
    config.addinivalue_line(
        "markers",
        "acceptance_matrix(brokers=..., stores=...): run a deployment test on these only",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "deployment" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("acceptance_matrix")
    brokers = marker.kwargs.get("brokers") if marker else None
    stores = marker.kwargs.get("stores") if marker else None
    pairs = [
        (broker, store)
        for broker, store in MATRIX
        if (brokers is None or broker in brokers) and (stores is None or store in stores)
    ]
    if not pairs:
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: acceptance_matrix selects none")
    metafunc.parametrize("deployment", pairs, ids=[f"{b}-{s}" for b, s in pairs], indirect=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here not in Path(str(item.fspath)).parents:
            continue
        item.add_marker(pytest.mark.acceptance)
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    if report.when == "call":
        item.acceptance_call_report = report  # type: ignore[attr-defined]
    return report


@pytest.fixture
def deployment(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Deployment]:
    """A fresh queue, store namespace and ledger on one (broker, store) pair; see harness."""
    broker, store = request.param
    services.need(SERVICE_OF[broker])
    services.need(SERVICE_OF[store])
    deployment = Deployment(broker, store, tmp_path)
    try:
        yield deployment
        report = getattr(request.node, "acceptance_call_report", None)
        if report is not None and report.failed and deployment.workers:
            print(f"worker logs of {deployment!r}:\n{deployment.logs()}")
    finally:
        deployment.close()


@pytest.fixture
def ledger(deployment: Deployment) -> Ledger:
    return deployment.ledger


@pytest.fixture
def gate() -> None:
    """Skip a test of the gated tasks until ``celery_exactonce.ExactOnceTask`` exists."""
    if not gate_available():
        pytest.skip("celery_exactonce.ExactOnceTask does not exist yet")
