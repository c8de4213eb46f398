"""The model's world: its state, the rules a variant may drop, its scenarios and bounds.

What it holds: the shape of a model state (one record, the actors, the
broker's queue, the body starts per attempt, the budgets, the store's epoch),
the switches of :class:`Rules` (all on: the design), the :class:`Scenario`
(who acts, which opt-ins are on), the :class:`Bounds` of a search and what
a search returns (:class:`Result`). The steps are in ``model.py``,
``dispatchers.py``, ``workers.py`` and ``reconcilers.py``; the search in
``checker.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from ._table import State

P, S, D, R = State.PENDING, State.SCHEDULED, State.DISPATCHED, State.RUNNING
OK, F, C, T = State.SUCCEEDED, State.FAILED, State.CANCELLED, State.TIMEOUT

Rec = tuple[State, int, int, int] | None  # (state, rev, attempt, run_id), or no record
Msg = tuple[int, tuple[int, ...], bool]  # (attempt, tickets, carries our headers)
Phase = tuple[Any, ...]
Actor = tuple[Phase, Msg | None]  # (phase, the message a worker holds unacked)


class St(NamedTuple):
    """One state of the model. Ids (revs, run ids) are only compared, never ordered."""

    rec: Rec
    actors: tuple[Actor, ...]
    queue: tuple[Msg, ...]
    starts: tuple[int, ...]  # body starts, per attempt
    faults: int  # store errors, publish failures, crashes, unreachable read-backs so far
    dups: int  # broker duplicates so far
    passes: int  # reconciler listings so far
    retries: int  # Celery retries so far
    losses: int  # store losses so far: also the store's epoch (0: its first life)
    ended: State | None  # the last terminal state written, kept across a loss
    next_id: int  # the next fresh rev or run id
    lock: int  # the worker holding the record's row lock, plus one (0: none); atomic only
    effects: int  # the body's effects committed so far; atomic only


Step = tuple[str, St, str | None]  # (label, next state, the property it breaks)

IDLE: Phase = ("idle",)
DONE: Phase = ("done",)
ACK: Phase = ("ack",)  # a worker acks its message and is idle again


@dataclasses.dataclass(frozen=True)
class Rules:
    """The protocol rules a variant may drop (all on: the design)."""

    gate_checks_attempt: bool = True
    """The gate's CAS (and its take-over) also requires the record's attempt to be
    the message's."""
    gate_reads_back_its_write: bool = True
    """A gate write whose answer is lost is settled by reading back the run_id
    (then, the store unreachable, sent back with tickets), instead of the
    delivery being requeued as it came."""
    send_back_tickets_need_takeover: bool = True
    """A copy holding a ticket takes the run over with a CAS from that run_id,
    instead of owning it outright."""
    dispatched_written_before_publish: bool = True
    """A dispatcher publishes only after its acknowledged ``DISPATCHED`` write."""
    dispatched_write_read_back: bool = True
    """A ``DISPATCHED`` write that errored (a dispatch, a replay, a retry) is read
    back, and its publish goes ahead if the record holds the writer's rev,
    instead of failing closed."""
    reconciler_uses_rev_cas: bool = True
    """The reconciler's writes are conditional on the rev it listed, not the state."""
    claims_carry_epoch: bool = True
    """A beat claim carries the epoch its node holds; the store refuses it under
    another epoch (the store lost its data since)."""
    claims_respect_floor: bool = True
    """A node claims no slot at or before its epoch's birth (plus ``max_skew``):
    a slot due before a loss may have been claimed in the life the store forgot."""
    gate_adopts_headerless_only: bool = True
    """With no record, the gate adopts only a message without our headers; one
    with them is not run (``record_lost``)."""
    resubmit_republishes: bool = True
    """A resubmission that finds the job ``DISPATCHED`` with nothing to prove its
    message left (the submit wrote the record, then published) writes
    ``DISPATCHED → DISPATCHED`` on the rev it read and publishes again; the gate
    drops a second copy."""
    outcome_checks_run_id: bool = True
    """A worker's outcome and retry are conditional on its run_id, not on the
    state ``RUNNING`` alone."""
    atomic_running_in_transaction: bool = True
    """An atomic job's gate CAS ``→ RUNNING`` is written inside the body's
    transaction (others see the job as it was until the commit), instead of
    being committed before the body."""
    atomic_outcome_with_effects: bool = True
    """An atomic job's outcome is written in the transaction of the body's effects,
    instead of in a write of its own after they commit."""


#: The scenarios: who acts (``D`` dispatcher, ``W`` worker, ``U`` the caller).
LAYOUTS: dict[str, str] = {
    "beat": "DDWW",  # beat nodes claim one occurrence
    "delayed": "UDDWW",  # a delayed job: the caller submits and may cancel; nodes sweep
    "enqueue": "UWW",  # the caller's one-step submit (record and message in one script)
    "foreign": "WW",  # a message without our headers and no record: adopted at the gate
}


@dataclasses.dataclass(frozen=True)
class Scenario:
    """Who acts, and which of the protocol's options are on."""

    start: str = "beat"
    """A key of :data:`LAYOUTS`. ``delayed`` also has deadlines, ``cancel()``
    and retries with a countdown (``RUNNING → PENDING``)."""
    losses: int = 0
    """Store losses: the record is wiped and the store's epoch changes. A node
    that crashes then restarts and reads the epoch."""
    rerun: bool = False
    """The reconciler's opt-ins: redispatch (``DISPATCHED → DISPATCHED``) and
    re-run (``RUNNING → DISPATCHED``, the next attempt)."""
    outcomes: tuple[State, ...] = (OK,)
    """What a body's end writes, each on the run_id."""
    liveness: bool = False
    """L is checked: no crash, no publish failure, and the reconciler lists a
    job only once no other step can move it (its timeouts are then accurate)."""
    carried: bool = True
    """A worker acks a delivery as its task returns and writes the outcome in a
    later step (carried to its thread's next gate write, or written by its
    heartbeat thread); a crash in between loses the outcome. ``False``: the
    outcome is written, then the delivery acked, in one step."""
    one_write: bool = True
    """The caller's submit (``enqueue``) writes the record ``DISPATCHED`` and its
    message in one script (the Redis store), which proves the message left;
    ``False``: it writes the record, then publishes (the SQL stores; the Redis
    store with another broker, which builds the message meanwhile but sends
    it only after the write's answer: the same steps here)."""
    atomic: bool = False
    """The workers run the job atomically: the gate, the body's effects on the
    store's database and the outcome commit in one transaction, which holds
    the record's row lock (another writer waits for it); a crash or a body's
    error rolls it all back. E1: the effects commit at most once; E2: a job
    ends ``SUCCEEDED`` exactly when they did (a failed body's end, ``FAILED``,
    and a cancel, without them); E3: the job never times out (nothing of a
    run that did not commit can have committed, so the reconciler
    redispatches it instead)."""


@dataclasses.dataclass(frozen=True)
class Bounds:
    """How far the search goes: a PASS means no violation within these."""

    faults: int = 2  # store errors, publish failures, crashes, unreachable read-backs
    dups: int = 1  # broker duplicates
    passes: int = 1  # reconciler listings
    retries: int = 1  # Celery retries (each a next attempt)
    reconcilers: int = 1  # reconciler passes that may overlap (their leases lapsed)
    misreported_definite: bool = True  # a "definite" publish failure whose message landed


@dataclasses.dataclass
class Result:
    """What one search found."""

    states: int
    violation: str | None = None
    trace: list[str] = dataclasses.field(default_factory=list)
    edges: set[tuple[State | None, State]] = dataclasses.field(default_factory=set)
    stuck: list[str] = dataclasses.field(default_factory=list)


def show(rec: Rec) -> str:
    """The record as a trace prints it."""
    if rec is None:
        return "<no record>"
    state, rev, att, run = rec
    return f"{state.value} rev{rev} att{att}" + (f" run{run}" if state is R else "")


def show_msg(msg: Msg) -> str:
    """A message as a trace prints it."""
    att, tickets, ours = msg
    return (
        f"m(att{att}"
        + (f", tickets {list(tickets)}" if tickets else "")
        + (")" if ours else ", no headers)")
    )
