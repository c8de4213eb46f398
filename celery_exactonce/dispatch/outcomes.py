"""What a dispatch did: its :class:`Outcome`, the :class:`DispatchResult`, and :class:`Enqueued`.

Values only, shared by the dispatch path (:mod:`~celery_exactonce.dispatch.dispatcher`),
its background retries (:mod:`~celery_exactonce.dispatch.retrier`) and their callers.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from celery_exactonce.core.jobs import Job


class Outcome(str, enum.Enum):
    """What one dispatch did. Every value but ``PUBLISHED`` and ``LOST`` is counted."""

    PUBLISHED = "published"
    """Handed to the broker (a plain job is now ``PUBLISHED``, a gated one ``DISPATCHED``)."""
    LOST = "lost"
    """The CAS lost: another dispatcher, a cancel or the reconciler moved the job first."""
    FAIL_CLOSED = "fail_closed"
    """The store could not be written or read back: nothing was published."""
    ROLLED_BACK = "rolled_back"
    """The publish failed definitely; the job is ``SCHEDULED`` again, to be retried."""
    ROLLBACK_FAILED = "rollback_failed"
    """The publish failed definitely and the rollback write failed too (reported)."""
    AMBIGUOUS = "ambiguous"
    """The broker may or may not have the message; the job stays ``DISPATCHED``."""
    FAILED = "failed"
    """Permanent: unknown task or unpublishable payload; the job is ``FAILED``."""
    EXPIRED = "expired"
    """Past its deadline before it could be published; the job is ``CANCELLED``."""


@dataclasses.dataclass(frozen=True)
class DispatchResult:
    outcome: Outcome
    job: Job | None = None
    error: BaseException | None = None
    #: What the publisher returned for a ``PUBLISHED`` job (``send_task``'s ``AsyncResult``).
    sent: Any = None


@dataclasses.dataclass(frozen=True)
class Enqueued:
    """What :meth:`Dispatcher.enqueue` did."""

    #: The record: the one written (``DISPATCHED``, its times this process's
    #: estimate), or the one that already existed.
    job: Job
    #: Whether the record and its message were created; ``False``: the job
    #: existed, nothing was written or pushed.
    created: bool
    #: What ``send_task`` returned for the message built (``AsyncResult``).
    sent: Any = None
