"""celery-exactonce: at-most-once dispatch for Celery.

Several ``celery beat`` nodes at once with each scheduled occurrence
dispatched once, durable delayed jobs, and a worker-side gate so that a
redelivered message never runs a task body twice. Effects are exactly-once
only where task code uses :func:`idempotency_key`.
"""

from __future__ import annotations

from celery_exactonce import startup as _startup  # noqa: F401  (connects the start-up checks)
from celery_exactonce.beat.scheduler import ExactOnceScheduler
from celery_exactonce.config import ExactOnceConfig
from celery_exactonce.core.exceptions import (
    ConfigurationError,
    ExactOnceError,
    InvalidPayload,
    JobConflict,
    LeaseLost,
    SchemaMismatch,
    StoreError,
    StoreUnavailable,
    SubmitAmbiguous,
)
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.keys import idempotency_key
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.reconcile.cancel import cancel
from celery_exactonce.stores import InMemoryStore, StateStore, open_store, store_from_url
from celery_exactonce.task.base import ExactOnceTask

__version__ = "0.1.0.dev0"

__all__ = [
    "ConfigurationError",
    "ExactOnceConfig",
    "ExactOnceError",
    "ExactOnceScheduler",
    "ExactOnceTask",
    "InMemoryStore",
    "InvalidPayload",
    "Job",
    "JobConflict",
    "JobRef",
    "LeaseLost",
    "SchemaMismatch",
    "State",
    "StateStore",
    "StoreError",
    "StoreUnavailable",
    "SubmitAmbiguous",
    "__version__",
    "cancel",
    "idempotency_key",
    "open_store",
    "store_from_url",
]
