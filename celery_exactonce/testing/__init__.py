"""Testing code that uses celery-exactonce: helpers, and a pytest plugin.

Helpers (no pytest needed):

* :class:`InMemoryStore` (re-exported): the whole store contract in a dict.
* :class:`FrozenClock`: a clock that moves only when told to, to give the
  in-memory store (and anything that takes a :class:`~celery_exactonce.core.clock.Clock`)
  a time that tests control without sleeping.
* :class:`ExactOnceJobs`: the jobs of an app, read and asserted on
  ("ran once"), and its due delayed jobs swept.
* :func:`configured` and :func:`in_process_worker`: an app set up for one
  test (in-memory broker, backend and store; eager or not), and a worker in
  a thread of this process.

The pytest plugin: this module is registered as the ``celery_exactonce``
plugin (a ``pytest11`` entry point), so installing the package gives every
test suite the ``exactonce_*`` fixtures (:mod:`celery_exactonce.testing.plugin`):
``exactonce_app``, ``exactonce_jobs``, ``exactonce_store``,
``exactonce_clock``, ``exactonce_worker``, ``exactonce_config``,
``exactonce_celery_app`` and ``exactonce_mode``, and the
``--exactonce-mode=eager|worker`` option. ``-p no:celery_exactonce`` turns it off.
"""

from __future__ import annotations

from celery_exactonce.stores.memory import InMemoryStore
from celery_exactonce.testing.apps import configured, in_process_worker
from celery_exactonce.testing.clock import FrozenClock
from celery_exactonce.testing.jobs import ExactOnceJobs

__all__ = ["ExactOnceJobs", "FrozenClock", "InMemoryStore", "configured", "in_process_worker"]

try:
    import pytest  # noqa: F401  (the plugin needs it; the helpers above do not)
except ImportError:  # pragma: no cover - pytest is not installed: helpers only
    pass
else:
    from celery_exactonce.testing.plugin import (  # noqa: F401  (pytest reads them from here)
        _exactonce_configured,
        exactonce_app,
        exactonce_celery_app,
        exactonce_clock,
        exactonce_config,
        exactonce_jobs,
        exactonce_mode,
        exactonce_store,
        exactonce_worker,
        pytest_addoption,
    )
