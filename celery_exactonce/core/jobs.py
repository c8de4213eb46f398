"""The job record, what a store answers, and the pure rules that apply requests to a record.

A store persists :class:`Job` records (each with its capped history of
:class:`HistoryEntry`) and applies :class:`~celery_exactonce.core.writes.NewJob`
and :class:`~celery_exactonce.core.writes.Transition` requests atomically,
answering with a :class:`CreateResult` or a :class:`TransitionResult`. The
rules that decide whether a request applies and what it writes live here, as
pure functions (:func:`job_from_new`, :func:`check_transition`,
:func:`apply_transition`, :func:`annotate_job`), so that the in-memory and SQL
stores share one implementation and the Redis Lua scripts have one reference
to agree with (the contract suite and the model-based test hold them to it).
A record's JSON form (:func:`job_to_json`, :func:`job_from_json`) is here too.

Not here: the requests themselves (:mod:`celery_exactonce.core.writes`); a job's
identity, tokens, and the rules for names and text (:mod:`celery_exactonce.core.refs`);
the JSON of payloads (:mod:`celery_exactonce.core.payload`); time conversions
(:mod:`celery_exactonce.core.times`); the transition table (:mod:`celery_exactonce.core.states`);
the record of the slots beat skipped (:mod:`celery_exactonce.core.skipped_slots`,
whose :class:`SkippedSlots` is importable from here as well).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from celery_exactonce.core.refs import (
    MAX_NAME_LENGTH,
    JobRef,
    sanitize_text,
    validate_identifier,
    validate_reason,
)
from celery_exactonce.core.skipped_slots import SkippedSlots as SkippedSlots  # noqa: PLC0414  (importable here)
from celery_exactonce.core.states import TERMINAL, State
from celery_exactonce.core.terminal import KEEP as KEEP  # noqa: PLC0414  (importable here)
from celery_exactonce.core.terminal import TERMINAL_HISTORY as TERMINAL_HISTORY  # noqa: PLC0414
from celery_exactonce.core.terminal import Compaction as Compaction  # noqa: PLC0414
from celery_exactonce.core.times import from_micros, from_micros_opt, to_micros, to_micros_opt
from celery_exactonce.core.writes import Action, NewJob, Transition

#: How many transitions a record remembers. Enough to explain a job's life
#: (create, claim, dispatch, a few retries, completion) without letting a job
#: that is replayed for days grow without bound.
HISTORY_LIMIT = 32


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
    """HMAC of the payload and identity (:mod:`celery_exactonce.stores.signing`), when signed."""

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


class CreateStatus(str, enum.Enum):
    """What a create-if-absent did. Lost races are values, not exceptions."""

    CREATED = "created"
    """This call created the record."""
    EXISTS = "exists"
    """A record with this ref exists (``job`` is it; its ``rev`` tells whether it is ours)."""
    BELOW_WATERMARK = "below_watermark"
    """No record, but the entry's watermark is at or past this slot: decided, never claimed."""
    EPOCH_MISMATCH = "epoch_mismatch"
    """The store's epoch is not the one the caller holds: the store lost data."""
    UNIQUE_HELD = "unique_held"
    """A live job holds the request's unique key (``job`` is it): nothing was written."""


@dataclasses.dataclass(frozen=True)
class CreateResult:
    status: CreateStatus
    job: Job | None = None
    epoch: str | None = None
    """The store's epoch at the time of the call, when it was checked."""

    @property
    def created(self) -> bool:
        return self.status is CreateStatus.CREATED


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


def apply_transition(job: Job, t: Transition, now: datetime, compaction: Compaction = KEEP) -> Job:
    """The record after ``t`` applied to ``job`` at store time ``now`` (guards not checked).

    A transition to a terminal state leaves the record as ``compaction`` keeps it.
    """
    entry = HistoryEntry(job.state, t.to, now, t.node, t.reason, t.new_rev, t.action)
    running = t.to is State.RUNNING
    resigned = t.args is not None or t.kwargs is not None or t.signature is not None
    updated = _replaced(
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
    if t.to in TERMINAL and compaction.compacts:
        return compact_terminal(updated, compaction)
    return updated


def compact_terminal(job: Job, compaction: Compaction) -> Job:
    """The terminal record ``job`` as ``compaction`` keeps it."""
    changes: dict[str, Any] = {}
    if compaction.history != "full":
        changes["history"] = job.history[-1:] if compaction.history == "last" else ()
    if not compaction.payload:
        changes.update(args=[], kwargs={}, options={}, signature=None)
    return _replaced(job, **changes)


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


def enqueued_job(new: NewJob, dispatch: Transition, now: datetime) -> Job:
    """The record an enqueue writes at store time ``now``: ``new`` created, ``dispatch``
    (``SCHEDULED → DISPATCHED``, no next attempt) applied. What ``apply_transition(
    job_from_new(new, now), dispatch, now)`` builds, in one step: a submit builds it each call.
    """
    created = HistoryEntry(None, new.state, now, new.node, new.reason, new.rev)
    d = dispatch
    entry = HistoryEntry(new.state, d.to, now, d.node, d.reason, d.new_rev, d.action)
    run_at = new.run_at if d.run_at is None else d.run_at
    return Job(
        new.ref, new.task, d.to, d.new_rev, 0, new.run_id,  # ref, task, state, rev, attempt
        list(new.args), dict(new.kwargs), dict(new.options), new.entry, new.fire_time, run_at,
        new.deadline, now, now, None, None, 1, d.node, d.reason,  # ... created, touched at
        (created, entry), new.signature,
    )  # fmt: skip


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
