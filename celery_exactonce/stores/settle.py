"""Settling writes: write, and if the answer is lost, read the record back and decide.

A store error raised after a request was sent leaves its outcome unknown
(:mod:`celery_exactonce.stores.base`). Every writer settles such a write the
same way, here, and never by guessing: it reads the record back (a few
tries, with back-off) and asks it whether it holds the write's op id, the
``new_rev`` of a :class:`~celery_exactonce.core.writes.Transition` or the ``rev`` of
a :class:`~celery_exactonce.core.writes.NewJob` (:meth:`~celery_exactonce.core.jobs.Job.applied`).

:func:`transition`, :func:`transition_many`, :func:`create` and
:func:`create_many` make the write and answer a :class:`Written`: the store's
own answer when it came, else the :class:`Decision` the record read back
supports. What to do with a write that is not known to have applied
(publish nothing, raise, count) stays the caller's.

A write read back as not applied may still be in flight (a server that has
not run it yet): no caller takes that for a refusal it may act on as if the
write could never land. A write read back as :attr:`Decision.SUPERSEDED`
applied, but the record has moved on since: the record read back is not the
one the write produced, and no caller acts on it as its own.

The worker gate settles its writes in its own loop
(:meth:`~celery_exactonce.task.gate.Delivery.enter`): it reads back until its
deadline, then sends the delivery back with the run ids it may have written,
and it knows its own write by that run id (a take-over or an adoption writes
another op id than the gate CAS, under the same run id).
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Sequence
from typing import Generic, TypeVar

from celery_exactonce.core import exceptions
from celery_exactonce.core.jobs import (
    CreateResult,
    CreateStatus,
    Job,
    TransitionResult,
    TransitionStatus,
)
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.stores.base import StateStore
from celery_exactonce.stores.unique import keeps_unique

__all__ = [
    "READ_BACK_DELAY",
    "READ_BACK_TRIES",
    "Decision",
    "ReadBack",
    "Written",
    "create",
    "create_many",
    "decide",
    "read_back",
    "transition",
    "transition_many",
]

#: How many times a writer tries to read back a write whose answer was lost, and
#: the pause after the first failed read (doubling after each further one).
READ_BACK_TRIES = 3
READ_BACK_DELAY = 0.05


class Decision(str, enum.Enum):
    """What a write did, as far as its writer can tell."""

    APPLIED = "applied"
    """The write applied and the record is still as it left it (its ``rev`` is the op id)."""
    SUPERSEDED = "superseded"
    """The write applied (its op id is in the history), then another write moved the record."""
    NOT_APPLIED = "not_applied"
    """The store refused it, or the record read back (or its absence) does not show it."""
    UNKNOWN = "unknown"
    """The answer was lost and the record could not be read back."""


S = TypeVar("S", TransitionStatus, CreateStatus)


@dataclasses.dataclass(frozen=True)
class Written(Generic[S]):
    """A write, settled: the store's answer, or what reading the record back decided."""

    decision: Decision
    job: Job | None = None
    """The record: as the store answered (``None`` for a brief answer that applied), or as
    read back (``None`` when there is none or it could not be read)."""
    status: S | None = None
    """The store's answer. When it was lost: ``None`` for a transition; for a create
    whose record was read back, ``EXISTS`` (what the create, repeated, answers)."""
    error: exceptions.StoreError | None = None
    """The error that lost the answer; ``None`` when the store answered."""

    @property
    def applied(self) -> bool:
        """Whether the write applied and the record is still as it left it."""
        return self.decision is Decision.APPLIED


@dataclasses.dataclass(frozen=True)
class ReadBack:
    """A record read back after a write whose answer was lost."""

    decision: Decision
    job: Job | None = None
    """The record, ``None`` when there is none or it could not be read."""


def decide(job: Job | None, op_id: str) -> Decision:
    """Whether the write ``op_id`` applied to ``job``, a record read back (``None``: none)."""
    if job is None:
        return Decision.NOT_APPLIED
    if job.rev == op_id:
        return Decision.APPLIED
    return Decision.SUPERSEDED if job.applied(op_id) else Decision.NOT_APPLIED


def read_back(
    store: StateStore,
    ref: JobRef,
    op_id: str,
    *,
    tries: int = READ_BACK_TRIES,
    delay: float = READ_BACK_DELAY,
) -> ReadBack:
    """Read ``ref`` back, up to ``tries`` times, and decide whether ``op_id`` applied to it.

    A failed read is tried again after ``delay`` seconds, doubling; when every
    read fails the decision is :attr:`Decision.UNKNOWN`.
    """
    for attempt in range(tries):
        if attempt:
            time.sleep(delay * 2 ** (attempt - 1))
        try:
            job = store.get(ref)
        except exceptions.StoreError:
            continue
        return ReadBack(decide(job, op_id), job)
    return ReadBack(Decision.UNKNOWN)


def transition(
    store: StateStore,
    ref: JobRef,
    request: Transition,
    *,
    brief: bool = False,
    tries: int = READ_BACK_TRIES,
) -> Written[TransitionStatus]:
    """CAS ``request`` on ``ref``; if the answer is lost, read back and decide.

    With ``brief`` the store may leave ``job`` unset when the CAS applied (it
    does not send the record back); a refused CAS still carries the record as
    it is. A brief CAS goes through
    :meth:`~celery_exactonce.stores.base.StateStore.transition_many`, which
    takes ``brief`` on every store.
    """
    try:
        if brief:
            (answer,) = store.transition_many([(ref, request)], brief=True)
        else:
            answer = store.transition(ref, request)
    except exceptions.StoreError as exc:
        return _lost_transition(store, ref, request, exc, tries)
    return _answered_transition(answer)


def transition_many(
    store: StateStore,
    requests: Sequence[tuple[JobRef, Transition]],
    *,
    brief: bool = False,
    tries: int = READ_BACK_TRIES,
) -> list[Written[TransitionStatus]]:
    """:func:`transition` for each ``(ref, request)`` in one batch; results in order.

    An error loses every answer of the batch: each write is read back on its own.
    """
    try:
        answers = store.transition_many(requests, brief=brief)
    except exceptions.StoreError as exc:
        return [_lost_transition(store, ref, request, exc, tries) for ref, request in requests]
    return [_answered_transition(answer) for answer in answers]


def create(
    store: StateStore,
    new: NewJob,
    *,
    epoch: str | None = None,
    brief: bool = False,
    tries: int = READ_BACK_TRIES,
) -> Written[CreateStatus]:
    """Create ``new`` if absent; if the answer is lost, read back and decide.

    A record read back answers as the create repeated would: ``EXISTS`` with it.
    With ``brief`` the store may leave ``job`` unset (an applied create, or an
    existing record): a brief create goes through
    :meth:`~celery_exactonce.stores.base.StateStore.create_many`, which takes
    ``brief`` on every store.
    """
    try:
        if brief:
            (answer,) = store.create_many([new], epoch=epoch, brief=True)
        else:
            answer = store.create(new, epoch=epoch)
    except exceptions.StoreError as exc:
        return _lost_create(store, new, exc, tries)
    return _answered_create(new, answer)


def create_unique(
    store: StateStore, new: NewJob, *, tries: int = READ_BACK_TRIES
) -> Written[CreateStatus]:
    """:func:`create` of a unique submission (``UNIQUE_HELD``: a live job holds its key).

    Raises :class:`~celery_exactonce.core.exceptions.ConfigurationError` on a store
    that keeps no unique keys.
    """
    if not keeps_unique(store):
        raise exceptions.ConfigurationError(
            f"{new.task}.exactonce_unique: the store of exactonce_store_url keeps no unique "
            "keys (Redis, not sharded; PostgreSQL, MySQL, SQLite and django:// do)",
            setting="exactonce_unique",
        )
    try:
        answer = store.create_unique(new)  # type: ignore[attr-defined]
    except exceptions.StoreError as exc:
        return _lost_create(store, new, exc, tries)
    return _answered_create(new, answer)


def create_many(
    store: StateStore,
    news: Sequence[NewJob],
    *,
    epoch: str | None = None,
    brief: bool = False,
    tries: int = READ_BACK_TRIES,
) -> list[Written[CreateStatus]]:
    """:func:`create` for each of ``news`` in one batch (``create_many``); results in order.

    An error loses every answer of the batch: each create is read back on its own.
    """
    try:
        answers = store.create_many(news, epoch=epoch, brief=brief)
    except exceptions.StoreError as exc:
        return [_lost_create(store, new, exc, tries) for new in news]
    return [_answered_create(new, answer) for new, answer in zip(news, answers, strict=True)]


def _answered_transition(answer: TransitionResult) -> Written[TransitionStatus]:
    decision = Decision.APPLIED if answer.applied else Decision.NOT_APPLIED
    return Written(decision, answer.job, answer.status)


def _lost_transition(
    store: StateStore, ref: JobRef, request: Transition, exc: exceptions.StoreError, tries: int
) -> Written[TransitionStatus]:
    found = read_back(store, ref, request.new_rev, tries=tries)
    return Written(found.decision, found.job, None, exc)


def _answered_create(new: NewJob, answer: CreateResult) -> Written[CreateStatus]:
    if answer.status is CreateStatus.CREATED:
        decision = Decision.APPLIED
    elif answer.status is CreateStatus.EXISTS:
        decision = decide(answer.job, new.rev)  # a repeat of a create that applied
    else:
        decision = Decision.NOT_APPLIED
    return Written(decision, answer.job, answer.status)


def _lost_create(
    store: StateStore, new: NewJob, exc: exceptions.StoreError, tries: int
) -> Written[CreateStatus]:
    found = read_back(store, new.ref, new.rev, tries=tries)
    status = None if found.job is None else CreateStatus.EXISTS
    return Written(found.decision, found.job, status, exc)
