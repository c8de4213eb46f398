"""Fixtures of the acceptance tests: a ``deployment`` per (broker, store) pair.

``deployment`` is parametrised over :data:`harness.MATRIX`; a test narrows it with
``@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis",))``. A test
that names its stores gets every named store (any of :data:`harness.STORES`,
``mysql`` and ``sqlite`` included) with every broker it allows. ``slow_stores=(...)``
marks the pairs on those stores ``slow``: a long run repeated store by store runs
on the other stores by default and on every store under ``-m slow`` (``tox -e chaos``).
Every test here is marked ``acceptance`` and gets a 180 s timeout.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import evidence, services
from tests.acceptance.django_project import django_database  # noqa: F401  (a fixture)
from tests.acceptance.harness import (
    BROKERS,
    MATRIX,
    SERVICE_OF,
    STORES,
    Deployment,
    Ledger,
    gate_available,
)

TEST_TIMEOUT = 180


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "acceptance: real celery worker processes on real brokers and stores"
    )
    config.addinivalue_line(
        "markers",
        "acceptance_matrix(brokers=..., stores=..., slow_stores=...): run a deployment test"
        " on these only; the pairs on slow_stores only under -m slow",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "deployment" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("acceptance_matrix")
    brokers = marker.kwargs.get("brokers") if marker else None
    stores = marker.kwargs.get("stores") if marker else None
    slow_stores = set(marker.kwargs.get("slow_stores", ())) if marker else set()
    for kind, names, known in (("broker", brokers, BROKERS), ("store", stores, STORES)):
        unknown = sorted(set(names or ()) - set(known))
        if unknown:
            raise pytest.UsageError(f"{metafunc.definition.nodeid}: unknown {kind}(s) {unknown}")
    if slow_stores - set(stores or ()):
        raise pytest.UsageError(
            f"{metafunc.definition.nodeid}: slow_stores {sorted(slow_stores)} "
            f"not all in stores {stores}"
        )
    # Named stores may be any of STORES; otherwise the default MATRIX.
    candidates = MATRIX if stores is None else tuple(itertools.product(BROKERS, stores))
    pairs = [
        (broker, store)
        for broker, store in candidates
        if (brokers is None or broker in brokers) and (stores is None or store in stores)
    ]
    if not pairs:
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: acceptance_matrix selects none")
    if all(store in slow_stores for _, store in pairs):  # the default run keeps one at least
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: every store is in slow_stores")
    params = [
        pytest.param(
            (broker, store),
            id=f"{broker}-{store}",
            marks=[pytest.mark.slow] if store in slow_stores else [],
        )
        for broker, store in pairs
    ]
    metafunc.parametrize("deployment", params, indirect=True)


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
    for service in (SERVICE_OF[broker], SERVICE_OF[store]):
        if service is not None:  # SQLite needs none
            services.need(service)
    deployment = Deployment(broker, store, tmp_path)
    try:
        yield deployment
        report = getattr(request.node, "acceptance_call_report", None)
        if report is not None and report.failed and (deployment.workers or deployment.beats):
            print(f"worker and beat logs of {deployment!r}:\n{deployment.logs()}")
        outcome = None if report is None else report.outcome
        evidence.record_deployment(request.node.nodeid, outcome, deployment)  # if asked
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
