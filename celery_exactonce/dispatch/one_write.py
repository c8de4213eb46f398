"""The one-write submit: the record written ``DISPATCHED`` by one store write, then published.

On a store whose ``enqueue`` writes the record alone (the SQL stores; the
Redis store when the broker is not on its server), a gated submit is that one
write, then the publish: no create, no ``DISPATCHED`` write of its own.
Nothing is sent before the write's answer says the record is ours.

Where the store can run a function while its write's answer is on the way
(``enqueue_overlaps``: the Redis store) and the publisher can build a message
without sending it (:meth:`~celery_exactonce.dispatch.publisher.CeleryPublisher.prepare`),
the message is built meanwhile, on the producer the publish then uses: the
round trip costs the submit only what building the message did not fill.
Celery's ``send_task`` has then run (its signals sent, its result made)
before the store answered; a job that existed gets no message, and its
result is the one built.

Not here: the one-step submit, record and message in one script
(:mod:`~celery_exactonce.dispatch.one_step`); the publish and its failures
(:mod:`~celery_exactonce.dispatch.dispatcher`, :mod:`~celery_exactonce.dispatch.failures`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any, Protocol

from celery_exactonce.core import exceptions, jobs
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.dispatch import messages
from celery_exactonce.dispatch.capture import Prepared
from celery_exactonce.dispatch.messages import GATED_OPTION
from celery_exactonce.dispatch.outcomes import DispatchResult, Enqueued, Outcome
from celery_exactonce.dispatch.publisher import Publisher, PublishFailed
from celery_exactonce.dispatch.retrier import Retrier
from celery_exactonce.stores import settle, signing
from celery_exactonce.stores.base import StateStore

#: A message built while the store's answer was on the way, or why it could not be.
Built = Prepared | PublishFailed | None


class Parts(Protocol):
    """What the one-write submit uses of its dispatcher, at each call (tests swap them)."""

    store: StateStore
    publisher: Publisher
    node: str
    signer: signing.Signer | None
    retrier: Retrier | None

    def _send(
        self, job: Job, extra: Mapping[str, Any], reason: str = "", built: Built = None
    ) -> DispatchResult: ...

    def _flushed(self, job: Job, sent: DispatchResult) -> DispatchResult: ...


class _Build:
    """Builds a job's message, as the store's ``meanwhile``; keeps it, or why it failed.

    All of it runs while the write's answer is on the way: the record the
    write will make (this process's estimate), and ``send_task``, captured
    or on a producer of the publisher's (held in ``held`` until the publish
    is done).
    """

    def __init__(
        self,
        new: NewJob,
        request: Transition,
        call: Mapping[str, Any],
        publisher: Any,
        namespace: str,
        held: contextlib.ExitStack,
    ) -> None:
        self._new, self._request, self._call = new, request, call
        self._publisher, self._namespace, self._held = publisher, namespace, held
        #: The record as this process expects the write to leave it (its times: before the
        #: write's answer), once built.
        self.job: Job | None = None
        self.built: Built = None

    def __call__(self) -> None:
        self.job = job = jobs.enqueued_job(self._new, self._request, _now())
        try:  # a producer it takes is held until the publish is done
            headers = messages.message_headers(job, self._namespace)
            self.built = self._publisher.prepare(job, headers, self._call, self._held)
        except PublishFailed as exc:
            self.built = exc
        except Exception as exc:  # no producer to build it on: nothing was sent
            self.built = PublishFailed(f"no producer: {exc}", definite=True)

    @property
    def sent(self) -> Any:
        """``send_task``'s result of the message built (``None``: none was)."""
        return self.built.sent if isinstance(self.built, Prepared) else None


class OneWrite:
    """The one-write submit of one dispatcher (see the module docs)."""

    def __init__(self, parts: Parts) -> None:
        self._parts = parts

    def enqueue(self, new: NewJob, reason: str, call: Mapping[str, Any]) -> Enqueued | None:
        """Write ``new`` ``DISPATCHED`` by the store's ``enqueue``, then publish it.

        ``None`` where this path does not apply (no such write, a plain job, a
        signing key, an occurrence, a deadline already past): the caller
        takes another. A definite publish failure rolls the record back to
        ``SCHEDULED``, retried in the background. Raises
        :class:`~celery_exactonce.core.exceptions.StoreError` when the write's
        outcome is unknown (no answer, and no record read back).
        """
        parts = self._parts
        enqueue = getattr(parts.store, "enqueue", None)
        if enqueue is None or not new.options.get(GATED_OPTION) or parts.signer is not None:
            return None
        if new.state is not State.SCHEDULED or new.entry is not None:
            return None
        if new.deadline is not None and new.deadline <= _now():
            return None  # the general path records the expiry
        request = Transition(
            State.DISPATCHED,
            frozenset({State.SCHEDULED}),
            node=parts.node,
            reason=reason,
            rev=new.rev,
        )
        with contextlib.ExitStack() as held:  # the producer a message built meanwhile took
            build = self._build(new, request, call, held)
            try:
                if build is None:
                    result = enqueue(new, request)
                else:
                    result = enqueue(new, request, meanwhile=build)
            except exceptions.StoreError:
                back = settle.read_back(parts.store, new.ref, request.new_rev, tries=1)
                if back.job is None:  # none yet, or unreadable: the write may still apply
                    raise
                if back.decision is not settle.Decision.APPLIED:  # another's, or ours moved on
                    return Enqueued(back.job, created=False, sent=build.sent if build else None)
                result = jobs.CreateResult(jobs.CreateStatus.CREATED, back.job)
            if not result.created:
                assert result.job is not None  # noqa: S101 (an existing record comes back)
                return Enqueued(result.job, created=False, sent=build.sent if build else None)
            job = result.job or _written(new, request, build)
            # A message built meanwhile goes out on the producer that built it (its batch,
            # in ``held``); else the one message is sent at once, outside a batch (not
            # buffered).
            sent = parts._send(job, call, reason, build.built if build is not None else None)
            sent = parts._flushed(job, sent)
        if sent.outcome in (Outcome.FAIL_CLOSED, Outcome.ROLLED_BACK) and parts.retrier is not None:
            parts.retrier.schedule(job.ref)
        return Enqueued(sent.job or job, created=True, sent=sent.sent)

    def _build(
        self, new: NewJob, request: Transition, call: Mapping[str, Any], held: contextlib.ExitStack
    ) -> _Build | None:
        """What builds the message while the store writes, where both can (else ``None``)."""
        store, publisher = self._parts.store, self._parts.publisher
        if not hasattr(publisher, "prepare"):
            return None
        if getattr(store, "enqueue_overlaps", False) is not True:
            return None
        return _Build(new, request, call, publisher, store.namespace, held)


def _written(new: NewJob, request: Transition, build: _Build | None) -> Job:
    """The record the write made, on this process's clock: the one the message was built
    from (the message holds none of its times), but where a deadline asks whether it
    passed during the write."""
    if build is not None and build.job is not None and new.deadline is None:
        return build.job
    return jobs.enqueued_job(new, request, _now())


def _now() -> datetime:
    return datetime.now(timezone.utc)
