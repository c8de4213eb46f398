"""Per-process runtime of one Celery app: its config, store client and dispatcher.

Store clients must not cross ``fork()`` (a prefork child would share its
parent's sockets), so the runtime is built lazily in each process and rebuilt
when the pid changes. The config is read and validated once per app.
"""

from __future__ import annotations

import socket
import threading
import time
import weakref
from typing import Any

from celery_exactonce.config import ExactOnceConfig
from celery_exactonce.core.refs import process_id
from celery_exactonce.dispatch import publisher
from celery_exactonce.dispatch.dispatcher import Dispatcher
from celery_exactonce.dispatch.retrier import Retrier
from celery_exactonce.stores import open_store, signing
from celery_exactonce.stores.base import StateStore


class Runtime:
    """What one process needs to dispatch and gate the jobs of one app."""

    def __init__(
        self,
        app: Any,
        config: ExactOnceConfig,
        store: StateStore | None = None,
        *,
        setup: bool = True,
    ) -> None:
        self.app = app
        self.config = config
        self.pid = process_id()
        self.node = config.node_id or f"{socket.gethostname()}:{self.pid}"
        self.owns_store = store is None
        self.store = store if store is not None else open_store(config, setup=setup)
        #: Signs every record this process writes, and the dispatcher refuses to
        #: publish one that does not verify (``None``: no ``exactonce_signing_key``).
        self.signer = signing.Signer.from_setting(config.signing_key)
        if self.signer is not None:
            self.store = signing.SigningStore(self.store, self.signer)
        self.dispatcher = Dispatcher(
            self.store,
            publisher.CeleryPublisher(app, timeout=config.publish_timeout),
            node=self.node,
            retrier=Retrier(first_delay=config.retry_delay_store, give_up_after=config.replay_age),
            signer=self.signer,
        )

        #: ``time.monotonic()`` of the last store-wide error any part of this process
        #: met (a beat tick, a heartbeat, a reconcile pass): the reconciler's grace
        #: period runs from it, as heartbeats may have failed all along.
        self.store_error_at: float | None = None

    def note_store_error(self, at: float | None = None) -> None:
        """Record that the store could not be reached just now (``at``: a monotonic time)."""
        at = time.monotonic() if at is None else at
        if self.store_error_at is None or at > self.store_error_at:
            self.store_error_at = at

    def close(self) -> None:
        """Close the store if this runtime opened it (one handed in belongs to its caller)."""
        if self.owns_store:
            self.store.close()


_lock = threading.Lock()
_runtimes: weakref.WeakKeyDictionary[Any, Runtime] = weakref.WeakKeyDictionary()
_configs: weakref.WeakKeyDictionary[Any, ExactOnceConfig] = weakref.WeakKeyDictionary()


def config_for(app: Any) -> ExactOnceConfig:
    """The validated config of ``app`` (read once)."""
    with _lock:
        config = _configs.get(app)
        if config is None:
            config = _configs[app] = ExactOnceConfig.from_app(app)
        return config


def runtime_for(app: Any, *, setup: bool = True) -> Runtime:
    """The runtime of ``app`` in this process, built on first use (and again after a fork).

    ``setup=False`` builds it without any I/O (the worker gate: a store outage
    must reach the gate's own error handling, not fail the task before it).
    """
    with _lock:
        runtime = _runtimes.get(app)
        if runtime is not None and runtime.pid == process_id():
            return runtime
    config = config_for(app)
    with _lock:
        runtime = _runtimes.get(app)
        if runtime is None or runtime.pid != process_id():
            runtime = _runtimes[app] = Runtime(app, config, setup=setup)
        return runtime


def installed(app: Any) -> Runtime | None:
    """The runtime of ``app`` already built in this process, or ``None`` (no I/O, no config)."""
    with _lock:
        runtime = _runtimes.get(app)
    return runtime if runtime is not None and runtime.pid == process_id() else None


def install(app: Any, store: StateStore, config: ExactOnceConfig | None = None) -> Runtime:
    """Use ``store`` for ``app`` in this process (tests, embedding: e.g. an InMemoryStore).

    A runtime it replaces is closed as :func:`reset` closes one: the store it
    opened itself is closed, one handed in is left to its caller.
    """
    runtime = Runtime(app, config or config_for(app), store)
    with _lock:
        replaced = _runtimes.get(app)
        _runtimes[app] = runtime
    if replaced is not None and replaced.pid == process_id() and replaced.store is not store:
        replaced.close()
    return runtime


def reset(app: Any) -> None:
    """Forget the runtime and config of ``app`` in this process (closing its store)."""
    with _lock:
        runtime = _runtimes.pop(app, None)
        _configs.pop(app, None)
    if runtime is not None and runtime.pid == process_id():
        runtime.close()
