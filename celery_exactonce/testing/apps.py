"""An app set up for one test: its settings, its store in memory, a worker in a thread.

* :func:`configured`: for the length of a ``with``, ``app`` runs on
  :data:`TEST_SETTINGS` (an in-memory broker, result backend and store: no
  server), eager or not, with the given :class:`InMemoryStore` as its store in
  this process. Everything is put back after: each setting as it was (one the
  app had not set is removed), and the app's runtime forgotten.
* :func:`in_process_worker`: a Celery worker in a thread of this process
  (Celery's own ``start_worker``, solo pool), consuming the app's queues.
  It shares the process, so it shares the in-memory broker and store.

The pytest plugin's fixtures are built on these; they work without pytest too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from celery_exactonce import runtime
from celery_exactonce.config import PREFIX, ExactOnceConfig
from celery_exactonce.core import exceptions
from celery_exactonce.stores.memory import InMemoryStore

__all__ = ["TEST_SETTINGS", "configured", "in_process_worker", "patched_settings"]

#: What every test app runs on: nothing here needs a server.
TEST_SETTINGS: Mapping[str, Any] = {
    "broker_url": "memory://",
    "result_backend": "cache+memory://",
    "exactonce_store_url": "memory://",
}

#: Added for an in-process worker: the memory broker polled often, the root logger left
#: to the test runner.
WORKER_SETTINGS: Mapping[str, Any] = {
    "broker_transport_options": {"polling_interval": 0.02},
    "worker_hijack_root_logger": False,
}


def _spellings(app: Any, key: str) -> list[str]:
    """The keys of ``app.conf`` that spell setting ``key`` (``CELERY_EXACTONCE_…`` too)."""
    if not key.startswith(PREFIX):
        return [key]
    namespace = (getattr(app, "namespace", None) or "").lower()
    found = []
    for spelled in list(app.conf.keys()):
        lowered = str(spelled).lower()
        if namespace and lowered.startswith(f"{namespace}_{PREFIX}"):
            lowered = lowered[len(namespace) + 1 :]
        if lowered == key:
            found.append(str(spelled))
    return found or [key]


@contextlib.contextmanager
def patched_settings(app: Any, settings: Mapping[str, Any]) -> Iterator[None]:
    """``app.conf`` with ``settings`` for the length of the ``with``; then as it was.

    An ``exactonce_*`` setting is written under every spelling the app already
    has for it (a Django project's ``CELERY_EXACTONCE_…``), so none is left
    to contradict it.
    """
    changes = app.conf.changes
    saved: dict[str, tuple[bool, Any]] = {}
    for key, value in settings.items():
        for spelled in _spellings(app, key):
            saved.setdefault(spelled, (spelled in changes, changes.get(spelled)))
            app.conf[spelled] = value
    try:
        yield
    finally:
        for spelled, (present, value) in saved.items():
            if present:
                app.conf[spelled] = value
            else:
                changes.pop(spelled, None)


def _forget_connections(app: Any) -> None:
    """Drop the broker pool and result backend ``app`` built, so the next use reads its settings."""
    app._pool = None
    amqp = app.__dict__.get("amqp")
    if amqp is not None:
        amqp._producer_pool = None
    app._backend_cache = None
    with contextlib.suppress(AttributeError):
        del app._local.backend


@contextlib.contextmanager
def configured(
    app: Any,
    store: InMemoryStore,
    *,
    settings: Mapping[str, Any] | None = None,
    eager: bool = True,
) -> Iterator[Any]:
    """``app`` set up for a test: :data:`TEST_SETTINGS`, ``settings`` over them, ``store``.

    ``eager`` sets ``task_always_eager`` (``settings`` may still override it).
    Yields the app.

    Raises
    ------
    ConfigurationError
        A setting is refused (as a worker would refuse it), or ``store`` is not
        in the app's ``exactonce_namespace``.
    """
    final = {**TEST_SETTINGS, "task_always_eager": eager}
    if not eager:
        final.update(WORKER_SETTINGS)
    final.update(settings or {})
    with patched_settings(app, final):
        runtime.reset(app)
        _forget_connections(app)
        try:
            config = ExactOnceConfig.from_app(app)
            if config.namespace != store.namespace:
                raise exceptions.ConfigurationError(
                    f"exactonce_namespace={config.namespace!r}, but the test store is in "
                    f"namespace {store.namespace!r}",
                    setting="exactonce_namespace",
                )
            runtime.install(app, store, config)
            yield app
        finally:
            runtime.reset(app)
            _forget_connections(app)


@contextlib.contextmanager
def in_process_worker(app: Any, **options: Any) -> Iterator[Any]:
    """A worker for ``app`` in a thread of this process, started and ready; stopped after.

    Celery's ``start_worker`` (solo pool, no ping task needed), with
    :data:`WORKER_SETTINGS` and ``task_always_eager`` off while it runs.
    ``options`` go to ``start_worker`` (``queues``, ``loglevel``,
    ``shutdown_timeout``...). One at a time in a process: stopping one stops
    Celery's process-wide worker state.
    """
    from celery.contrib.testing.worker import start_worker

    options = {"pool": "solo", "perform_ping_check": False, "shutdown_timeout": 10.0, **options}
    with (
        patched_settings(app, {**WORKER_SETTINGS, "task_always_eager": False}),
        start_worker(app, **options) as worker,
    ):
        try:
            yield worker
        finally:
            # Its consumer waits up to 2 s per poll of an idle memory broker before it
            # looks at Celery's stop flag; a remote-control shutdown ends the wait now.
            with contextlib.suppress(Exception):  # no remote control: the flag, slower
                app.control.shutdown(destination=[worker.hostname])
