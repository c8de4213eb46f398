"""The requests a store applies: create a job (:class:`NewJob`), move it (:class:`Transition`).

A :class:`NewJob` asks a store to create a record if none with its ref
exists; a :class:`Transition` asks it to compare-and-swap a record to another
state if every guard holds (one of them a :class:`Lease`), and says what the
write changes. :class:`Action` names the reconciler's action a transition is,
which the history entry records. A request checks itself when it is built
(its identifiers, its edges against the transition table of
:mod:`celery_exactonce.core.states`, a payload that can be stored), so a request no
store could apply fails before anything is written.

Not here: the record, the results a store answers with and the pure rules that
apply a request to a record (:func:`~celery_exactonce.core.jobs.job_from_new`,
:func:`~celery_exactonce.core.jobs.check_transition`,
:func:`~celery_exactonce.core.jobs.apply_transition`): :mod:`celery_exactonce.core.jobs`.
How each backend runs a request: :mod:`celery_exactonce.stores`.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from celery_exactonce.core import exceptions
from celery_exactonce.core.payload import plain_parts, storable_payload
from celery_exactonce.core.refs import (
    MAX_NAME_LENGTH,
    JobRef,
    Space,
    new_token,
    sanitize_text,
    validate_identifier,
    validate_reason,
)
from celery_exactonce.core.states import ALLOWED, CREATABLE, NEXT_ATTEMPT_EDGES, State
from celery_exactonce.core.times import require_aware


class Action(str, enum.Enum):
    """The reconciler's actions on a job, recorded in its history; its caps count them."""

    REPLAY = "replay"
    """A ``SCHEDULED`` job nobody dispatched, dispatched."""
    REDISPATCH = "redispatch"
    """An opted-in ``DISPATCHED`` job that never ran, published again."""
    RERUN = "rerun"
    """An opted-in ``RUNNING`` job whose worker vanished, dispatched as its next attempt."""

    @classmethod
    def of(cls, value: object) -> Action | None:
        """The action ``value`` names; ``None`` for none, or one this version does not know."""
        try:
            return None if value is None else cls(value)
        except ValueError:
            return None


#: The option a unique submission's key is stored under (``ExactOnceTask.exactonce_unique``):
#: while a live job holds it, a submission with the same key is that job.
UNIQUE_OPTION = "exactonce_unique"


@dataclasses.dataclass(frozen=True)
class NewJob:
    """A request to create a job if no record with its ``ref`` exists.

    For an occurrence (``ref.space`` is :attr:`Space.OCCURRENCE`), ``entry`` and
    ``fire_time`` are required: the create also checks and advances the entry's
    durable watermark in the same atomic step.
    """

    ref: JobRef
    task: str
    state: State
    node: str
    args: Sequence[Any] = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    entry: str | None = None
    fire_time: datetime | None = None
    run_at: datetime | None = None
    deadline: datetime | None = None
    run_id: str | None = None
    reason: str = "created"
    rev: str = dataclasses.field(default_factory=new_token)
    signature: str | None = None
    """Set by :class:`~celery_exactonce.stores.signing.SigningStore` under a signing key."""
    payload_json: tuple[str, str, str] | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )
    """The JSON texts of ``args``, ``kwargs`` and ``options`` as the stores write them,
    encoded once when the request is built; ``None`` for a payload with kombu-typed
    values (a store encodes those itself). The payload of a request is not changed
    after it is built."""

    @property
    def unique(self) -> str | None:
        """The key of a unique submission (:data:`UNIQUE_OPTION`), or ``None``."""
        key = self.options.get(UNIQUE_OPTION)
        return key if isinstance(key, str) else None

    def __post_init__(self) -> None:
        validate_identifier(self.task, "task name", MAX_NAME_LENGTH)
        if self.signature is not None:
            validate_identifier(self.signature, "signature", MAX_NAME_LENGTH)
        validate_identifier(self.node, "node id", MAX_NAME_LENGTH)
        validate_identifier(self.rev, "rev", MAX_NAME_LENGTH)
        validate_reason(self.reason)
        object.__setattr__(self, "reason", sanitize_text(self.reason))
        if self.state not in CREATABLE:
            raise exceptions.InvalidRequest(
                f"a job cannot be created in state {self.state}; "
                f"only {', '.join(sorted(s.value for s in CREATABLE))}"
            )
        occurrence = self.ref.space is Space.OCCURRENCE
        if occurrence != (self.entry is not None) or occurrence != (self.fire_time is not None):
            raise exceptions.InvalidRequest(
                f"job {self.ref}: an occurrence needs entry and fire_time, other jobs take neither"
            )
        if self.entry is not None:
            validate_identifier(self.entry, "entry key", MAX_NAME_LENGTH)
        if (self.state is State.PENDING) != (self.run_at is not None):
            raise exceptions.InvalidRequest(
                f"job {self.ref}: run_at is set exactly for PENDING jobs"
            )
        if (self.state is State.RUNNING) != (self.run_id is not None):
            raise exceptions.InvalidRequest(
                f"job {self.ref}: run_id is set exactly for RUNNING jobs"
            )
        for name in ("fire_time", "run_at", "deadline"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, require_aware(value, name))
        # Freeze the payload as JSON now: a payload that cannot be stored fails
        # here, before anything is written. A plain one (the common case) is
        # encoded once, its texts kept for the store that writes them.
        args, kwargs, options = list(self.args), dict(self.kwargs), dict(self.options)
        texts = plain_parts(args, kwargs, options)
        if texts is None:
            payload = storable_payload(
                {"args": args, "kwargs": kwargs, "options": options}, context=str(self.ref)
            )
            args, kwargs, options = (
                list(payload["args"]),
                dict(payload["kwargs"]),
                dict(payload["options"]),
            )
        object.__setattr__(self, "args", args)
        object.__setattr__(self, "kwargs", kwargs)
        object.__setattr__(self, "options", options)
        object.__setattr__(self, "payload_json", texts)

    @property
    def payload(self) -> dict[str, Any]:
        return {"args": self.args, "kwargs": self.kwargs, "options": self.options}

    def for_slot(self, ref: JobRef, fire_time: datetime, deadline: datetime | None) -> NewJob:
        """This occurrence's job for another slot of its entry, checked and encoded once.

        ``ref``, ``fire_time`` and ``deadline`` are the slot's, ``rev`` is new,
        ``signature`` none (it covered this job's id); the rest, the payload
        and its JSON texts included, is this job's (a request's payload is
        never changed once built), so the slot's job costs no second check or
        encoding. Beat builds each entry's job once and takes one per slot
        from it.
        """
        if self.entry is None or ref.space is not Space.OCCURRENCE:
            raise exceptions.InvalidRequest(f"job {self.ref}: only an occurrence has slots")
        job = copy.copy(self)
        object.__setattr__(job, "ref", ref)
        object.__setattr__(job, "fire_time", require_aware(fire_time, "fire_time"))
        if deadline is not None:
            deadline = require_aware(deadline, "deadline")
        object.__setattr__(job, "deadline", deadline)
        object.__setattr__(job, "rev", new_token())
        object.__setattr__(job, "signature", None)
        return job


@dataclasses.dataclass(frozen=True)
class Lease:
    """A lease held under a token; stores check it atomically with a transition."""

    name: str
    token: str

    def __post_init__(self) -> None:
        validate_identifier(self.name, "lease name", MAX_NAME_LENGTH)
        validate_identifier(self.token, "lease token", MAX_NAME_LENGTH)


@dataclasses.dataclass(frozen=True)
class Transition:
    """A compare-and-swap request: move a job to ``to`` if every guard holds.

    Guards (all that are set must hold, atomically with the write):

    * the current state is in ``expect``;
    * ``rev``: the current rev equals it (dispatchers, reconciler, release, cancel);
    * ``attempt``: the current attempt equals it (the worker gate);
    * ``run_id``: the current run id equals it (worker writes);
    * ``task``: the job is for this task name (the worker gate: a message for
      one task never runs on the record of another);
    * ``lease``: the lease is held with that token (the reconciler);
    * ``stale_for``: the job was last touched (transition or heartbeat) at
      least this many seconds ago, by the store's clock at the write.

    Effects: state, a new ``rev`` (``new_rev``, chosen by the caller so a
    write that timed out can be settled by reading back), the history entry,
    and optionally a new ``run_id``, the next attempt, a new ``run_at`` and
    new args/kwargs (a Celery retry may change them), with their ``signature``:
    a transition that changes args or kwargs replaces the stored signature by
    its own (none if it has none), so a signature never outlives its payload.
    """

    to: State
    expect: frozenset[State]
    node: str
    reason: str
    rev: str | None = None
    attempt: int | None = None
    run_id: str | None = None
    lease: Lease | None = None
    stale_for: float | None = None
    task: str | None = None
    new_run_id: str | None = None
    next_attempt: bool = False
    run_at: datetime | None = None
    args: Sequence[Any] | None = None
    kwargs: Mapping[str, Any] | None = None
    new_rev: str = dataclasses.field(default_factory=new_token)
    signature: str | None = None
    #: The reconciler's action this transition is, recorded in the history entry.
    action: Action | None = None

    def __post_init__(self) -> None:
        expect = self.expect
        if type(expect) is not frozenset or not all(type(s) is State for s in expect):
            expect = frozenset(State(s) for s in expect)
            object.__setattr__(self, "expect", expect)
        problem = _edges_problem(expect, self.to, self.next_attempt)
        if problem is not None:
            raise exceptions.InvalidRequest(problem)
        if (self.to is State.RUNNING) != (self.new_run_id is not None):
            raise exceptions.InvalidRequest("new_run_id is set exactly for transitions to RUNNING")
        if (self.to is State.PENDING) != (self.run_at is not None):
            raise exceptions.InvalidRequest("run_at is set exactly for transitions to PENDING")
        if self.run_at is not None:
            object.__setattr__(self, "run_at", require_aware(self.run_at, "run_at"))
        if (
            self.args is not None or self.kwargs is not None or self.signature is not None
        ) and not self.next_attempt:
            raise exceptions.InvalidRequest(
                "args/kwargs/signature change only with the next attempt"
            )
        if self.signature is not None:
            validate_identifier(self.signature, "signature", MAX_NAME_LENGTH)
        if self.args is not None or self.kwargs is not None:
            payload = storable_payload(
                {"args": list(self.args or ()), "kwargs": dict(self.kwargs or {})},
                context="transition",
            )
            if self.args is not None:
                object.__setattr__(self, "args", list(payload["args"]))
            if self.kwargs is not None:
                object.__setattr__(self, "kwargs", dict(payload["kwargs"]))
        if self.stale_for is not None and self.stale_for < 0:
            raise exceptions.InvalidRequest("stale_for must be >= 0 seconds")
        if self.task is not None:
            validate_identifier(self.task, "task name", MAX_NAME_LENGTH)
        validate_identifier(self.node, "node id", MAX_NAME_LENGTH)
        validate_identifier(self.new_rev, "rev", MAX_NAME_LENGTH)
        validate_reason(self.reason)
        object.__setattr__(self, "reason", sanitize_text(self.reason))


@functools.lru_cache(maxsize=256)
def _edges_problem(expect: frozenset[State], to: State, next_attempt: bool) -> str | None:
    """What is wrong with the edges ``expect → to`` (``None``: nothing), remembered:
    a process asks about few, for every write."""
    if not expect:
        return "a transition needs at least one expected state"
    for src in sorted(expect):
        if to not in ALLOWED[src]:
            return f"transition {src} → {to} is not allowed"
        if ((src, to) in NEXT_ATTEMPT_EDGES) != next_attempt:
            return (
                f"transition {src} → {to}: next_attempt must be {(src, to) in NEXT_ATTEMPT_EDGES}"
            )
    return None
