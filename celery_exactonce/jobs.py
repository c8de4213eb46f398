"""Jobs and the requests that create and move them: value objects and pure rules.

A store persists :class:`Job` records and applies :class:`NewJob` and
:class:`Transition` requests atomically. The rules that decide whether a
request applies live here, as pure functions (:func:`check_transition`,
:func:`apply_transition`), so that the in-memory and SQL stores share one
implementation and the Redis Lua scripts have one reference to agree with
(the contract suite and the model-based test hold them to it).

Times are timezone-aware UTC :class:`~datetime.datetime` values at microsecond
precision; stores keep them as integer microseconds since the UNIX epoch
(:mod:`celery_exactonce.times` converts them).

Payloads (args, kwargs, options) are stored as JSON (:mod:`celery_exactonce.payload`
encodes and decodes them). Free text we store (reasons) is made storable on every
backend by :func:`~celery_exactonce.refs.sanitize_text`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from celery_exactonce import exceptions
from celery_exactonce.payload import storable_payload
from celery_exactonce.refs import (
    MAX_NAME_LENGTH,
    JobRef,
    Space,
    new_token,
    sanitize_text,
    validate_identifier,
    validate_reason,
)
from celery_exactonce.states import (
    ALLOWED,
    CREATABLE,
    NEXT_ATTEMPT_EDGES,
    TERMINAL,
    State,
)
from celery_exactonce.times import (
    from_micros,
    from_micros_opt,
    require_aware,
    to_micros,
    to_micros_opt,
)

#: How many transitions a record remembers. Enough to explain a job's life
#: (create, claim, dispatch, a few retries, completion) without letting a job
#: that is replayed for days grow without bound.
HISTORY_LIMIT = 32


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


@dataclasses.dataclass(frozen=True)
class HistoryEntry:
    """One transition in a job's capped history.

    ``reason`` is for people; ``action`` says, for the code that counts them,
    which of the reconciler's actions wrote the entry (``None``: none of them).
    """

    src: State | None
    dst: State
    at: datetime
    node: str
    reason: str
    rev: str
    action: Action | None = None

    def to_json(self) -> dict[str, Any]:
        data = {
            "from": self.src.value if self.src else None,
            "to": self.dst.value,
            "at": to_micros(self.at),
            "node": self.node,
            "reason": self.reason,
            "rev": self.rev,
        }
        if self.action is not None:
            data["action"] = self.action.value
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> HistoryEntry:
        src = data.get("from")
        return cls(
            src=State(src) if src else None,
            dst=State(data["to"]),
            at=from_micros(int(data["at"])),
            node=str(data["node"]),
            reason=str(data["reason"]),
            rev=str(data["rev"]),
            action=Action.of(data.get("action")),
        )


@dataclasses.dataclass(frozen=True)
class Job:
    """A stored job record, as read from a store. Immutable; stores return new ones."""

    ref: JobRef
    task: str
    state: State
    rev: str
    """Globally unique token written by every transition (the op id of that write)."""
    attempt: int
    run_id: str | None
    args: list[Any]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    entry: str | None
    """The beat entry's key, for an occurrence."""
    fire_time: datetime | None
    """The nominal slot, for an occurrence."""
    run_at: datetime | None
    """When a delayed job is due."""
    deadline: datetime | None
    """After this instant the job must not run (the message's ``expires``)."""
    created_at: datetime
    touched_at: datetime
    """Last transition or heartbeat, on the store's clock: what staleness is measured from."""
    heartbeat_at: datetime | None
    terminal_at: datetime | None
    dispatches: int
    """How many times the job went to ``DISPATCHED`` (replays and redispatches included)."""
    node: str
    reason: str
    history: tuple[HistoryEntry, ...] = ()
    signature: str | None = None
    """HMAC of the payload and identity (:mod:`celery_exactonce.signing`), when signed."""

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def payload(self) -> dict[str, Any]:
        """The JSON payload: args, kwargs and options."""
        return {"args": self.args, "kwargs": self.kwargs, "options": self.options}

    def expires_at(self, retention: float) -> datetime | None:
        """When a terminal record may be purged; ``None`` while the job is live."""
        if self.terminal_at is None:
            return None
        start = max(self.terminal_at, self.fire_time or self.terminal_at)
        return from_micros(to_micros(start) + int(retention * 1_000_000))

    def applied(self, op_id: str) -> bool:
        """Whether the write whose op id (new ``rev``) is ``op_id`` applied to this record.

        This is how a writer settles a write that timed out: read the record
        back and ask it (:mod:`celery_exactonce.stores.settle` does, for every
        writer). True too when a later write has moved the record on since.
        """
        return self.rev == op_id or any(h.rev == op_id for h in self.history)


_JOB_FIELDS = frozenset(field.name for field in dataclasses.fields(Job))


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
    """Set by :class:`~celery_exactonce.signing.SigningStore` when a signing key is configured."""

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
        # here, before anything is written.
        payload = storable_payload(
            {"args": list(self.args), "kwargs": dict(self.kwargs), "options": dict(self.options)},
            context=str(self.ref),
        )
        object.__setattr__(self, "args", list(payload["args"]))
        object.__setattr__(self, "kwargs", dict(payload["kwargs"]))
        object.__setattr__(self, "options", dict(payload["options"]))

    @property
    def payload(self) -> dict[str, Any]:
        return {"args": self.args, "kwargs": self.kwargs, "options": self.options}


class CreateStatus(str, enum.Enum):
    """What a create-if-absent did. Lost races are values, not exceptions."""

    CREATED = "created"
    """This call created the record."""
    EXISTS = "exists"
    """A record with this ref exists (``job`` is it; its ``rev`` tells whether it is ours)."""
    BELOW_WATERMARK = "below_watermark"
    """No record, but the entry's watermark is at or past this slot: settled, never claimed."""
    EPOCH_MISMATCH = "epoch_mismatch"
    """The store's epoch is not the one the caller holds: the store lost data."""


@dataclasses.dataclass(frozen=True)
class CreateResult:
    status: CreateStatus
    job: Job | None = None
    epoch: str | None = None
    """The store's epoch at the time of the call, when it was checked."""

    @property
    def created(self) -> bool:
        return self.status is CreateStatus.CREATED


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


class TransitionStatus(str, enum.Enum):
    APPLIED = "applied"
    CONFLICT = "conflict"
    """A guard failed; ``job`` is the record as it is."""
    NOT_FOUND = "not_found"
    LEASE_LOST = "lease_lost"
    """The lease named in the request is not held with its token."""


@dataclasses.dataclass(frozen=True)
class TransitionResult:
    status: TransitionStatus
    job: Job | None = None

    @property
    def applied(self) -> bool:
        return self.status is TransitionStatus.APPLIED


# -- pure rules shared by the stores ---------------------------------------------------


def check_transition(job: Job, t: Transition, now: datetime) -> bool:
    """Whether every guard of ``t`` except the lease holds for ``job`` at store time ``now``."""
    if job.state not in t.expect or job.terminal:
        return False
    if t.rev is not None and job.rev != t.rev:
        return False
    if t.attempt is not None and job.attempt != t.attempt:
        return False
    if t.run_id is not None and job.run_id != t.run_id:
        return False
    if t.task is not None and job.task != t.task:
        return False
    if t.stale_for is not None:
        age = (to_micros(now) - to_micros(job.touched_at)) / 1_000_000
        if age < t.stale_for:
            return False
    return True


def _replaced(job: Job, **changes: Any) -> Job:
    """``dataclasses.replace(job, **changes)``, without its walk over every field.

    A :class:`Job` has no ``__post_init__`` and every field is in ``__init__``,
    so a copy of its fields is what ``replace`` would build; a write builds
    one per record (the gate, every dispatch).
    """
    unknown = changes.keys() - _JOB_FIELDS
    if unknown:
        raise TypeError(f"Job has no field {sorted(unknown)[0]!r}")
    out = object.__new__(Job)
    out.__dict__.update(job.__dict__)
    out.__dict__.update(changes)
    return out


def apply_transition(job: Job, t: Transition, now: datetime) -> Job:
    """The record after ``t`` applied to ``job`` at store time ``now`` (guards not checked)."""
    entry = HistoryEntry(job.state, t.to, now, t.node, t.reason, t.new_rev, t.action)
    running = t.to is State.RUNNING
    resigned = t.args is not None or t.kwargs is not None or t.signature is not None
    return _replaced(
        job,
        state=t.to,
        rev=t.new_rev,
        attempt=job.attempt + 1 if t.next_attempt else job.attempt,
        run_id=t.new_run_id if running else (None if t.next_attempt else job.run_id),
        args=list(t.args) if t.args is not None else job.args,
        kwargs=dict(t.kwargs) if t.kwargs is not None else job.kwargs,
        # A next attempt waits for its own run_at, or none: the last one's is gone.
        run_at=t.run_at if t.run_at is not None or t.next_attempt else job.run_at,
        touched_at=now,
        heartbeat_at=now if running else job.heartbeat_at,
        terminal_at=now if t.to in TERMINAL else None,
        dispatches=job.dispatches + (1 if t.to is State.DISPATCHED else 0),
        node=t.node,
        reason=t.reason,
        history=(*job.history, entry)[-HISTORY_LIMIT:],
        signature=t.signature if resigned else job.signature,
    )


def check_note(node: str, reason: str, op_id: str) -> str:
    """Refuse a bad node id or op id (:class:`InvalidPayload`); the reason as stored."""
    validate_identifier(node, "node id", MAX_NAME_LENGTH)
    validate_identifier(op_id, "op id", MAX_NAME_LENGTH)
    validate_reason(reason)
    return sanitize_text(reason)


def annotate_job(job: Job, *, node: str, reason: str, op_id: str, now: datetime) -> Job:
    """The record with a note appended to its history (store time ``now``); nothing else moves.

    A note is a history entry from the job's state to itself whose ``rev`` is
    ``op_id`` (so :meth:`Job.applied` settles a note whose answer was lost):
    the state, the rev, ``touched_at`` (what staleness is measured from) and
    every other field stay as they are. Appending the same ``op_id`` again
    changes nothing.
    """
    if any(entry.rev == op_id for entry in job.history):
        return job
    entry = HistoryEntry(job.state, job.state, now, node, reason, op_id)
    return _replaced(job, history=(*job.history, entry)[-HISTORY_LIMIT:])


def job_from_new(new: NewJob, now: datetime) -> Job:
    """The record a create of ``new`` writes at store time ``now``."""
    return Job(
        ref=new.ref,
        task=new.task,
        state=new.state,
        rev=new.rev,
        attempt=0,
        run_id=new.run_id,
        args=list(new.args),
        kwargs=dict(new.kwargs),
        options=dict(new.options),
        entry=new.entry,
        fire_time=new.fire_time,
        run_at=new.run_at,
        deadline=new.deadline,
        created_at=now,
        touched_at=now,
        heartbeat_at=now if new.state is State.RUNNING else None,
        terminal_at=None,
        dispatches=0,
        node=new.node,
        reason=new.reason,
        history=(HistoryEntry(None, new.state, now, new.node, new.reason, new.rev),),
        signature=new.signature,
    )


# -- encoding ----------------------------------------------------------------------------


def job_to_json(job: Job) -> dict[str, Any]:
    """A JSON-able dict of a job (times as integer microseconds)."""
    return {
        "ref": str(job.ref),
        "task": job.task,
        "state": job.state.value,
        "rev": job.rev,
        "attempt": job.attempt,
        "run_id": job.run_id,
        "args": job.args,
        "kwargs": job.kwargs,
        "options": job.options,
        "entry": job.entry,
        "fire_time": to_micros_opt(job.fire_time),
        "run_at": to_micros_opt(job.run_at),
        "deadline": to_micros_opt(job.deadline),
        "created_at": to_micros(job.created_at),
        "touched_at": to_micros(job.touched_at),
        "heartbeat_at": to_micros_opt(job.heartbeat_at),
        "terminal_at": to_micros_opt(job.terminal_at),
        "dispatches": job.dispatches,
        "node": job.node,
        "reason": job.reason,
        "history": [h.to_json() for h in job.history],
        "signature": job.signature,
    }


def job_from_json(data: Mapping[str, Any]) -> Job:
    """Inverse of :func:`job_to_json`."""
    return Job(
        ref=JobRef.parse(data["ref"]),
        task=data["task"],
        state=State(data["state"]),
        rev=data["rev"],
        attempt=int(data["attempt"]),
        run_id=data.get("run_id") or None,
        args=list(data.get("args") or []),
        kwargs=dict(data.get("kwargs") or {}),
        options=dict(data.get("options") or {}),
        entry=data.get("entry") or None,
        fire_time=from_micros_opt(data.get("fire_time")),
        run_at=from_micros_opt(data.get("run_at")),
        deadline=from_micros_opt(data.get("deadline")),
        created_at=from_micros(int(data["created_at"])),
        touched_at=from_micros(int(data["touched_at"])),
        heartbeat_at=from_micros_opt(data.get("heartbeat_at")),
        terminal_at=from_micros_opt(data.get("terminal_at")),
        dispatches=int(data.get("dispatches") or 0),
        node=data["node"],
        reason=data["reason"],
        history=tuple(HistoryEntry.from_json(h) for h in data.get("history") or ()),
        signature=data.get("signature") or None,
    )
