"""Unique submissions: a create that yields to the live job holding its key.

A gated task with ``exactonce_unique`` gives each submission a key (its task
and the arguments named, or what its key function returns:
:mod:`~celery_exactonce.task.unique`). While a job with that key is live (not
terminal), a submission with the same key creates nothing and answers that
job; once it has ended, the next one creates a new job. No lock, no TTL: the
holder's own state decides, and a holder whose worker died ends through the
reconciler as any job does, which frees its key.

Each store keeps, per namespace, an index from key to the last job created
with it, written in the same atomic step as the create
(:meth:`UniqueCreates.create_unique`), and reads the holder's state there
too: an index entry whose job ended, or was purged, holds nothing.

Not here: the key (:mod:`~celery_exactonce.task.unique`), the submit that uses it
(:mod:`~celery_exactonce.task.submit`).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from celery_exactonce.core.jobs import CreateResult
from celery_exactonce.core.writes import NewJob


@runtime_checkable
class UniqueCreates(Protocol):
    """A store that keeps unique keys."""

    def create_unique(self, new: NewJob) -> CreateResult:
        """Create ``new`` unless a live job other than it holds ``new.unique``. Atomic.

        In one atomic step: the job the key's index names is read; if it
        exists, is not terminal and is not ``new.ref``, nothing is written and
        the status is ``UNIQUE_HELD`` with that job. Otherwise the create
        proceeds as :meth:`~celery_exactonce.stores.base.StateStore.create`
        (``EXISTS`` for a record with ``new.ref``), and a created job becomes
        the key's holder. ``new`` must have a key (``new.unique``).

        Repeating a call that applied answers ``EXISTS`` with the record (its
        ``rev`` equals ``new.rev``), as a repeated create does.
        """
        ...


def keeps_unique(store: Any) -> bool:
    """Whether ``store`` can create unique submissions (a wrapping store: if what it wraps can)."""
    inner = getattr(store, "inner", None)
    return isinstance(store, UniqueCreates) and (inner is None or keeps_unique(inner))
