"""The one-step submit: the record and its message written by one Redis script.

Where the broker is a Redis on the store's own server, a submit needs no
``DISPATCHED`` write before a publish: one script creates the record already
``DISPATCHED`` and pushes the message kombu would have pushed, so both exist
or neither does. :class:`OneStep` decides whether a submit can take this
path, captures the message (:mod:`~celery_exactonce.dispatch.capture`) and runs the
script. Not here: the general path (:mod:`~celery_exactonce.dispatch.dispatcher`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any, Protocol

from celery_exactonce.core import exceptions, jobs
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.dispatch import messages
from celery_exactonce.dispatch.outcomes import Enqueued
from celery_exactonce.dispatch.publisher import Publisher, PublishFailed
from celery_exactonce.observe import metrics
from celery_exactonce.stores import settle, signing
from celery_exactonce.stores.base import StateStore
from celery_exactonce.stores.redis.store import Push, PushRefused

#: How a history tells a dispatch written with its message.
ENQUEUED = "(record and message in one step)"


class Parts(Protocol):
    """What the one-step submit reads of its dispatcher, at each call (tests swap them)."""

    store: StateStore
    publisher: Publisher
    node: str
    signer: signing.Signer | None


class OneStep:
    """The one-step submit of one dispatcher (see the module docs)."""

    def __init__(self, parts: Parts) -> None:
        self._parts = parts
        #: Set once the store's Redis refused a push (an ACL, say): never tried again.
        self._refused = False

    @property
    def store(self) -> StateStore:
        return self._parts.store

    @property
    def publisher(self) -> Publisher:
        return self._parts.publisher

    @property
    def node(self) -> str:
        return self._parts.node

    @property
    def signer(self) -> signing.Signer | None:
        return self._parts.signer

    def enqueue(
        self, new: NewJob, *, reason: str = "dispatch", call: Mapping[str, Any] | None = None
    ) -> Enqueued | None:
        """Create ``new`` (``SCHEDULED``) already ``DISPATCHED``, with its message, in one call.

        Where the broker is a Redis on the store's own server (a
        :class:`~celery_exactonce.stores.redis.store.RedisStore`, and a publisher that
        can :meth:`~celery_exactonce.dispatch.publisher.CeleryPublisher.capture` the
        message kombu would push), one script writes the record and pushes the
        message: both exist or neither does, so no publish is ambiguous and
        none needs a rollback. ``None`` where this cannot be done (another
        broker, a signing key, a deadline already past, a push Redis refused):
        the caller takes the general path, :meth:`dispatch` after a create.

        Raises :class:`~celery_exactonce.core.exceptions.StoreError` when the
        outcome is unknown (the answer was lost and the record could not be
        read back, or was not there yet).
        """
        enqueue = getattr(self.store, "enqueue", None)
        shares_server = getattr(self.store, "shares_server", None)
        capture = getattr(self.publisher, "capture", None)
        if enqueue is None or shares_server is None or capture is None or self._refused:
            return None
        capturable = getattr(self.publisher, "capturable", None)
        if capturable is not None and not capturable():  # known before building anything
            return None
        if new.state is not State.SCHEDULED or self.signer is not None:
            return None
        request = Transition(
            State.DISPATCHED,
            frozenset({State.SCHEDULED}),
            node=self.node,
            reason=f"{reason} {ENQUEUED}",
            rev=new.rev,
        )
        now = datetime.now(timezone.utc)
        job = jobs.enqueued_job(new, request, now)
        if job.deadline is not None and job.deadline <= now:
            return None  # the general path records the expiry
        headers = messages.message_headers(job, self.store.namespace)
        try:
            captured = capture(job, headers, call or {}, shares_server)
        except PublishFailed:
            return None  # the general path fails the job, with the reason
        if captured is None:
            return None
        try:
            result = enqueue(new, request, Push(captured.db, captured.commands))
        except PushRefused as exc:
            self._refused = True
            metrics.event(
                "enqueue_refused",
                f"the store's Redis refused to push a message to the broker's database ({exc}): "
                "this process publishes through the broker connection from now on",
                level=logging.WARNING,
                job_id=new.ref.id,
                task=new.task,
            )
            return None
        except exceptions.StoreError:
            back = settle.read_back(self.store, new.ref, request.new_rev)
            if back.job is None:  # none yet, or unreadable: the script may still run
                raise
            if back.decision is settle.Decision.NOT_APPLIED:
                return Enqueued(back.job, created=False, sent=captured.sent)
            # Ours, perhaps already moved on by a worker's gate (superseded).
            result = jobs.CreateResult(jobs.CreateStatus.CREATED, back.job)
        if not result.created:
            assert result.job is not None  # noqa: S101 (an existing record comes back)
            return Enqueued(result.job, created=False, sent=captured.sent)
        metrics.event(
            "dispatched",
            "job %s created and published in one step",
            job.ref,
            level=logging.DEBUG,
            job_id=job.ref.id,
            task=job.task,
            attempt=0,
        )
        return Enqueued(result.job or job, created=True, sent=captured.sent)
