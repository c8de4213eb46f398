"""Store write failures and store outages in a real process, driven by the environment.

``ledger_app`` calls :func:`install_store_faults` at import. When
``EXACTONCE_ACC_STORE_WRITE_FAILURES`` is a fraction above 0 (``0.1``: one
write in ten), the write methods of every store class of the package
(``RedisStore``, ``SqlStore``, ``InMemoryStore``) are wrapped in this process
so that that fraction of calls raises
:class:`~celery_exactonce.core.exceptions.StoreUnavailable`:

* half of them **before** the write: nothing reached the store;
* half **after** it applied: the store changed, the answer is lost. That is
  the realistic ambiguous case a writer must settle by reading back.

The failures alternate, before, after, before...; which calls fail is
random, seeded by ``EXACTONCE_ACC_STORE_FAULT_SEED`` (default ``0``): a
process makes the same choices, call for call, on every run (threads
interleaving their calls aside).
``EXACTONCE_ACC_STORE_FAULT_METHODS`` (comma-separated) replaces the default
set of wrapped methods, :data:`WRITE_METHODS`. Reads (``get``, ``list_stale``,
``now``...) are never failed: only writes are.

``EXACTONCE_ACC_STORE_OUTAGE_FILE`` names a file: while it exists, every store
operation of the process (:data:`OPERATIONS`, reads included) raises
``StoreUnavailable`` before reaching the store, as when the store is down. It
is the outage switch for a store no TCP proxy can cut (SQLite, a file); a test
creates the file for the outage and removes it when the store "returns".

Each injected failure is logged on the ``celery_exactonce.acc.store_faults``
logger with ``action = "acc_store_fault"`` and ``when`` (``before``/``after``)
and ``method`` fields, so a beat's JSON event file (``EXACTONCE_ACC_EVENTS``)
lists them; a :data:`FAULTS_MARK` line on stderr at install says the faults
are on. Set it on the process under test only (a beat): the test process
reads the store directly and must not fail.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

from celery_exactonce.core import exceptions

#: The store methods that write, and so may be failed.
WRITE_METHODS = (
    "create",
    "create_many",
    "transition",
    "transition_many",
    "claim_due",
    "heartbeat",
    "purge_expired",
)

#: The line written to stderr once the faults are installed.
FAULTS_MARK = "exactonce-acc store faults:"

#: Every operation of a store (``StateStore``) that an outage fails.
OPERATIONS = (
    *WRITE_METHODS,
    "now",
    "epoch",
    "get",
    "watermark",
    "watermarks",
    "list_stale",
    "acquire_lease",
    "renew_lease",
    "release_lease",
    "ping",
)

ACTION = "acc_store_fault"

logger = logging.getLogger("celery_exactonce.acc.store_faults")

_installed: list[tuple[type, str, Callable[..., Any]]] = []


class _Faults:
    """The seeded coin a wrapped write tosses, and the outage switch (shared by all threads)."""

    def __init__(self, rate: float, seed: int, writes: set[str], outage_file: str) -> None:
        self.rate = rate
        self.writes = writes
        self.outage_file = outage_file
        self._rng = random.Random(seed)
        self._faults = 0
        self._lock = threading.Lock()
        self._depth = threading.local()  # a wrapped method calling another: one toss

    def toss(self) -> str | None:
        """``None`` (the write goes through), ``"before"`` or ``"after"``."""
        if self.rate <= 0:
            return None
        with self._lock:
            if self._rng.random() >= self.rate:
                return None
            self._faults += 1  # alternate: exactly half of the failures come after the write
            return "before" if self._faults % 2 else "after"

    def wrap(self, method: Callable[..., Any], name: str) -> Callable[..., Any]:
        write = name in self.writes

        @functools.wraps(method)
        def faulty(store: Any, *args: Any, **kwargs: Any) -> Any:
            if self.outage_file and os.path.exists(self.outage_file):
                raise exceptions.StoreUnavailable(f"injected: store down ({name})")
            depth = getattr(self._depth, "n", 0)
            when = self.toss() if write and depth == 0 else None
            if when == "before":
                _report(name, when)
                raise exceptions.StoreUnavailable(f"injected: {name} failed before the write")
            self._depth.n = depth + 1
            try:
                result = method(store, *args, **kwargs)
            finally:
                self._depth.n = depth
            if when == "after":
                _report(name, when)
                raise exceptions.StoreUnavailable(f"injected: {name} applied, the answer lost")
            return result

        faulty.__exactonce_acc_fault__ = True  # type: ignore[attr-defined]
        return faulty


def _report(method: str, when: str) -> None:
    logger.warning(
        "injected store fault: %s %s the write",
        method,
        when,
        extra={"action": ACTION, "method": method, "when": when},
    )


def _store_classes() -> list[type]:
    """The package's store classes whose driver is installed."""
    from celery_exactonce.stores.memory import InMemoryStore

    classes: list[type] = [InMemoryStore]
    try:
        from celery_exactonce.stores.redis.store import RedisStore

        classes.append(RedisStore)
    except ImportError:  # pragma: no cover - the redis extra is missing
        pass
    try:
        from celery_exactonce.stores.sql.store import SqlStore

        classes.append(SqlStore)
    except ImportError:  # pragma: no cover - the sql extras are missing
        pass
    return classes


def install_store_faults(env: Mapping[str, str]) -> bool:
    """Wrap the store classes' methods as ``EXACTONCE_ACC_STORE_*`` say; whether it did.

    Idempotent: a second call (a second import) changes nothing.
    """
    rate = float(env.get("EXACTONCE_ACC_STORE_WRITE_FAILURES") or 0)
    outage_file = env.get("EXACTONCE_ACC_STORE_OUTAGE_FILE") or ""
    if (rate <= 0 and not outage_file) or _installed:
        return False
    if rate > 1:
        raise ValueError(f"EXACTONCE_ACC_STORE_WRITE_FAILURES={rate!r}: a fraction in [0, 1]")
    seed = int(env.get("EXACTONCE_ACC_STORE_FAULT_SEED") or 0)
    methods = env.get("EXACTONCE_ACC_STORE_FAULT_METHODS") or ",".join(WRITE_METHODS)
    writes = {name.strip() for name in methods.split(",") if name.strip()}
    faults = _Faults(rate, seed, writes, outage_file)
    wrapped = (set(OPERATIONS) if outage_file else set()) | writes
    for cls in _store_classes():
        for name in sorted(wrapped):
            method = cls.__dict__.get(name)
            if method is None or getattr(method, "__exactonce_acc_fault__", False):
                continue
            _installed.append((cls, name, method))
            setattr(cls, name, faults.wrap(method, name))
    sys.stderr.write(
        f"{FAULTS_MARK} rate={rate:g} seed={seed} methods={','.join(sorted(writes))} "
        f"outage_file={outage_file or '-'}\n"
    )
    sys.stderr.flush()
    return True


def uninstall_store_faults() -> None:
    """Put the original methods back (for tests of this module)."""
    while _installed:
        cls, name, method = _installed.pop()
        setattr(cls, name, method)
