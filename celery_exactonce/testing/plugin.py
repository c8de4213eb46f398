"""The pytest plugin's fixtures and option (registered as ``celery_exactonce``, see the package).

Every name starts with ``exactonce_``, so it sits beside ``celery.contrib.pytest``
(``celery_app``, ``celery_worker``...) and pytest-celery without a clash, and
uses none of theirs. Nothing here is autouse: a test that asks for none of
these fixtures runs as if the plugin were not installed.

Fixtures (function scope):

* ``exactonce_mode``: ``"eager"`` or ``"worker"``, from ``--exactonce-mode``
  or the ``exactonce_mode`` ini option (``eager`` by default); parametrize it
  to run a test both ways;
* ``exactonce_clock``: a :class:`FrozenClock` at the time the test starts;
* ``exactonce_config``: settings to apply over the test settings (override it);
* ``exactonce_celery_app``: the app under test; override it to return yours
  (by default a fresh app, current while the test runs, so ``shared_task``
  tasks bind to it);
* ``exactonce_store``: the :class:`InMemoryStore` the app uses, on the frozen clock;
* ``exactonce_app``: the app configured for the test (``testing.apps.configured``),
  with a worker running in worker mode;
* ``exactonce_worker``: an in-process worker on it (eager mode is off while it runs);
* ``exactonce_jobs``: an :class:`ExactOnceJobs` on the app's store.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import pytest

from celery_exactonce.stores.memory import InMemoryStore
from celery_exactonce.task.eager import namespace_of
from celery_exactonce.testing import apps
from celery_exactonce.testing.clock import FrozenClock
from celery_exactonce.testing.jobs import ExactOnceJobs

MODES = ("eager", "worker")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("celery-exactonce")
    group.addoption(
        "--exactonce-mode",
        choices=MODES,
        default=None,
        help="how exactonce_app runs tasks: eager (in the caller) or worker (an in-process "
        "worker thread). Default: the exactonce_mode ini option, else eager.",
    )
    parser.addini(
        "exactonce_mode", "default of --exactonce-mode (eager or worker)", default="eager"
    )


@pytest.fixture
def exactonce_mode(request: pytest.FixtureRequest) -> str:
    """How ``exactonce_app`` runs tasks: ``"eager"`` or ``"worker"``."""
    mode = request.config.getoption("exactonce_mode") or request.config.getini("exactonce_mode")
    mode = str(mode or "eager")
    if mode not in MODES:
        raise pytest.UsageError(f"exactonce_mode={mode!r}: expected one of {', '.join(MODES)}")
    return mode


@pytest.fixture
def exactonce_clock() -> FrozenClock:
    """A clock that stands still at the test's start until the test moves it (the store's)."""
    return FrozenClock(datetime.now(timezone.utc))


@pytest.fixture
def exactonce_config() -> dict[str, Any]:
    """Settings applied over the test settings for each test; override to add yours."""
    return {}


@pytest.fixture
def exactonce_celery_app() -> Iterator[Any]:
    """The Celery app under test. Override it to return your project's app.

    By default a fresh app, current and default while the test runs.
    """
    from celery import Celery, _state

    previous_current, previous_default = _state.get_current_app(), _state.default_app
    app = Celery("exactonce-tests", set_as_current=True)
    app.set_default()
    try:
        yield app
    finally:
        _state.set_default_app(previous_default)
        previous_current.set_current()
        app.close()


@pytest.fixture
def exactonce_store(
    exactonce_celery_app: Any, exactonce_config: dict[str, Any], exactonce_clock: FrozenClock
) -> InMemoryStore:
    """The in-memory store the app uses in this test, in its namespace, on the frozen clock."""
    namespace = exactonce_config.get("exactonce_namespace") or namespace_of(exactonce_celery_app)
    return InMemoryStore(str(namespace), clock=exactonce_clock)


@pytest.fixture
def _exactonce_configured(
    exactonce_celery_app: Any,
    exactonce_store: InMemoryStore,
    exactonce_config: dict[str, Any],
    exactonce_mode: str,
) -> Iterator[Any]:
    with apps.configured(
        exactonce_celery_app,
        exactonce_store,
        settings=exactonce_config,
        eager=exactonce_mode == "eager",
    ) as app:
        yield app


@pytest.fixture
def exactonce_worker(_exactonce_configured: Any) -> Iterator[Any]:
    """A worker for the app in a thread of this process (eager mode off while it runs)."""
    with apps.in_process_worker(_exactonce_configured) as worker:
        yield worker


@pytest.fixture
def exactonce_app(
    request: pytest.FixtureRequest, _exactonce_configured: Any, exactonce_mode: str
) -> Any:
    """The app configured for this test: eager, or with an in-process worker running."""
    if exactonce_mode == "worker":
        request.getfixturevalue("exactonce_worker")
    return _exactonce_configured


@pytest.fixture
def exactonce_jobs(exactonce_app: Any, exactonce_clock: FrozenClock) -> ExactOnceJobs:
    """The app's jobs: inspect them, assert a body ran once, sweep due delayed jobs."""
    return ExactOnceJobs(exactonce_app, clock=exactonce_clock)
