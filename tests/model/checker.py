"""A breadth-first, explicit-state model of one job's life, and its checker.

What it holds: the model's state (one record, the actors, the broker's queue,
the body starts per attempt, the fault budgets), every step an actor can take
from a state, the safety properties checked on each step, and the search that
returns the shortest trace to the first violation (docs/design/protocol.md,
"What the model checks").

Actors: beat nodes D1, D2 (claim, CAS ``SCHEDULED → DISPATCHED``, publish,
roll back after a definite failure), workers W1, W2 with ``acks_late`` (gate,
take-over by ticket, send-back, body, outcome or one Celery retry), one
reconciler R (replays ``SCHEDULED``, times out ``DISPATCHED`` and ``RUNNING``),
a broker that may duplicate any message, and a store whose writes may fail
before they apply or apply and then time out (the caller reads back).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterator
from typing import Any

from celery_exactonce.core.states import State

S, D, R, OK, TO = State.SCHEDULED, State.DISPATCHED, State.RUNNING, State.SUCCEEDED, State.TIMEOUT

Rec = tuple[State, int, int, int] | None  # (state, rev, attempt, run_id) or no record
Msg = tuple[int, tuple[int, ...]]  # (attempt, tickets)
Phase = tuple[Any, ...]
Actor = tuple[Phase, Msg | None]  # (phase, the message a worker holds unacked)
# (record, actors, queue, body starts per attempt, faults, dups, passes, retries, next id)
St = tuple[Rec, tuple[Actor, ...], tuple[Msg, ...], tuple[int, ...], int, int, int, int, int]
Step = tuple[str, St, str | None]  # (label, next state, violation)

NAMES = ("D1", "D2", "W1", "W2", "R")
NODES, WORKERS, RECON = (0, 1), (2, 3), 4
IDLE: Phase = ("idle",)
DONE: Phase = ("done",)
ACK: Phase = ("ack",)  # a worker acks its message and is idle again


@dataclasses.dataclass(frozen=True)
class Rules:
    """The protocol rules a variant may drop (all on: the design)."""

    gate_checks_attempt: bool = True
    """The gate's CAS also requires the record's attempt to be the message's."""
    send_back_tickets_need_takeover: bool = True
    """A copy holding a ticket takes the run over with a CAS from that run_id,
    instead of owning it outright."""
    dispatched_written_before_publish: bool = True
    """A dispatcher publishes only after its acknowledged ``DISPATCHED`` write."""
    reconciler_uses_rev_cas: bool = True
    """The reconciler's writes are conditional on the rev it listed, not the state."""


@dataclasses.dataclass(frozen=True)
class Bounds:
    """How far the search goes: a PASS means no violation within these."""

    faults: int = 2  # store errors, publish failures, crashes, unreachable read-backs
    dups: int = 1  # broker duplicates
    passes: int = 1  # reconciler listings
    retries: int = 1  # Celery retries (each a next attempt)
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
    if rec is None:
        return "<no record>"
    state, rev, att, run = rec
    return f"{state.value} rev{rev} att{att}" + (f" run{run}" if state is R else "")


class Model:
    """The steps of one job's life under ``rules``, within ``bounds``."""

    def __init__(self, rules: Rules | None = None, bounds: Bounds | None = None) -> None:
        self.rules = rules or Rules()
        self.bounds = bounds or Bounds()
        self.edges: set[tuple[State | None, State]] = set()

    def initial(self) -> St:
        actors: tuple[Actor, ...] = ((("start",), None),) * 2 + ((IDLE, None),) * 3
        return (None, actors, (), (0,) * (self.bounds.retries + 2), 0, 0, 0, 0, 1)

    # --- helpers: each returns a new state --------------------------------------

    @staticmethod
    def _set(s: St, i: int, phase: Phase, msg: Msg | bool | None = True) -> St:
        actors = list(s[1])
        if phase == ACK:
            phase, msg = IDLE, None
        actors[i] = (phase, actors[i][1] if msg is True else msg)  # type: ignore[assignment]
        return (s[0], tuple(actors), *s[2:])

    @staticmethod
    def _fresh(s: St) -> tuple[int, St]:
        return s[8], (*s[:8], s[8] + 1)

    @staticmethod
    def _fault(s: St) -> St:
        return (*s[:4], s[4] + 1, *s[5:])

    @staticmethod
    def _queue(s: St, msg: Msg) -> St:
        return (s[0], s[1], tuple(sorted((*s[2], msg))), *s[3:])

    def _faults_left(self, s: St) -> bool:
        return s[4] < self.bounds.faults

    def _write(
        self,
        s: St,
        i: int,
        what: str,
        ok: bool,
        new: Rec,
        yes: Phase,
        no: Phase,
        unreach: Phase | None = None,
    ) -> Iterator[Step]:
        """A conditional write by actor ``i``: applied, refused, or failed either way."""
        who = f"{NAMES[i]} {what}"
        if not ok:
            yield f"{who}: refused", self._set(s, i, no), None
            return
        assert new is not None
        old = s[0]
        self.edges.add((old[0] if old else None, new[0]))
        bad = None
        if old is not None and old[0].terminal:
            bad = f"S2: terminal {old[0].value} changed to {new[0].value}"
        applied: St = (new, *s[1:])
        yield f"{who}: ok", self._set(applied, i, yes), bad
        if self._faults_left(s):
            key = ("rev", new[1]) if new[0] is not R else ("run", new[3])
            check = ("check", key, yes, no, unreach)
            yield (
                f"{who}: applied, then the store timed out",
                self._fault(self._set(applied, i, check)),
                bad,
            )
            yield f"{who}: store error, not applied", self._fault(self._set(s, i, check)), None

    def _publish(
        self, s: St, i: int, att: int, acked: int | None, after: Phase, rollback: int | None
    ) -> Iterator[Step]:
        msg: Msg = (att, ())
        bad = None
        if acked != att:
            bad = f"S3: {NAMES[i]} publishes attempt {att} without its own acknowledged " + (
                "DISPATCHED write" if acked is None else f"write, which was for attempt {acked}"
            )
        yield f"{NAMES[i]} publishes m(att{att}): ok", self._queue(self._set(s, i, after), msg), bad
        if not self._faults_left(s):
            return
        f = self._fault(s)
        yield (
            f"{NAMES[i]} publishes m(att{att}): ambiguous, landed",
            self._queue(self._set(f, i, after), msg),
            bad,
        )
        yield f"{NAMES[i]} publishes m(att{att}): ambiguous, lost", self._set(f, i, after), bad
        back = ("rollback", rollback) if rollback is not None else after
        yield f"{NAMES[i]} publishes m(att{att}): definite failure", self._set(f, i, back), None
        if self.bounds.misreported_definite:
            yield (
                f"{NAMES[i]} publishes m(att{att}): 'definite' failure, but it landed",
                self._queue(self._set(f, i, back), msg),
                bad,
            )

    # --- the steps ----------------------------------------------------------------

    def steps(self, s: St) -> Iterator[Step]:
        actors, queue = s[1], s[2]
        for i, (phase, msg) in enumerate(actors):
            if i in (1, 3) and actors[i] == actors[i - 1]:
                continue  # two alike actors in one place: the first one's steps stand for both
            yield from self._actor(s, i, phase, msg)
            if msg is not None and self._faults_left(s):
                yield (
                    f"{NAMES[i]} crashes; its unacked m(att{msg[0]}) is redelivered",
                    self._fault(self._queue(self._set(s, i, IDLE, None), msg)),
                    None,
                )
            elif i in NODES and phase[0] not in ("done", "start") and self._faults_left(s):
                yield f"{NAMES[i]} crashes", self._fault(self._set(s, i, DONE)), None
        for n, msg in enumerate(queue):
            if n and queue[n - 1] == msg:
                continue
            rest = queue[:n] + queue[n + 1 :]
            for w in WORKERS:
                if actors[w][0] == IDLE and not (w == 3 and actors[2][0] == IDLE):
                    got = self._set((s[0], s[1], rest, *s[3:]), w, ("gate", ()), msg)
                    yield f"{NAMES[w]} receives m(att{msg[0]}, tickets {list(msg[1])})", got, None
        if s[5] < self.bounds.dups:
            held = [m for _, m in actors if m is not None]
            for msg in sorted(set(queue) | set(held)):
                dup = self._queue((*s[:5], s[5] + 1, *s[6:]), msg)
                yield f"broker duplicates m(att{msg[0]}, tickets {list(msg[1])})", dup, None

    def _actor(self, s: St, i: int, phase: Phase, msg: Msg | None) -> Iterator[Step]:
        rec, kind = s[0], phase[0]
        if kind == "check":  # read back whether our write applied
            _, (field, value), yes, no, unreach = phase
            held = rec is not None and (
                rec[1] == value if field == "rev" else rec[0] is R and rec[3] == value
            )
            yield (
                f"{NAMES[i]} reads back: {'applied' if held else 'not applied'}",
                self._set(s, i, yes if held else no),
                None,
            )
            if unreach is not None and self._faults_left(s):
                yield (
                    f"{NAMES[i]} cannot read back (store unreachable)",
                    self._fault(self._set(s, i, unreach)),
                    None,
                )
        elif kind == "start":  # a beat node claims the occurrence
            rev, t = self._fresh(s)
            yield from self._write(
                t,
                i,
                "claims (create-if-absent SCHEDULED)",
                rec is None,
                (S, rev, 0, 0),
                ("claimed", rev),
                DONE,
            )
        elif kind == "claimed":
            if self.rules.dispatched_written_before_publish:
                rev, t = self._fresh(s)
                ok = rec is not None and rec[0] is S and rec[1] == phase[1]
                new = (D, rev, rec[2], 0) if rec is not None else None
                att = rec[2] if rec is not None else 0
                yield from self._write(
                    t, i, "CAS SCHEDULED->DISPATCHED", ok, new, ("pub", att, att, DONE, rev), DONE
                )
            else:
                yield from self._publish(s, i, 0, None, ("late", phase[1]), None)
        elif kind == "late":  # the dropped rule: the DISPATCHED write after the publish
            rev, t = self._fresh(s)
            ok = rec is not None and rec[0] is S and rec[1] == phase[1]
            new = (D, rev, rec[2], 0) if rec is not None else None
            yield from self._write(t, i, "CAS SCHEDULED->DISPATCHED", ok, new, DONE, DONE)
        elif kind == "pub":
            yield from self._publish(s, i, phase[1], phase[2], phase[3], phase[4])
        elif kind == "rollback":
            rev, t = self._fresh(s)
            end = DONE if i in NODES else ACK if i in WORKERS else IDLE
            ok = rec is not None and rec[0] is D and rec[1] == phase[1]
            new = (S, rev, rec[2], 0) if rec is not None else None
            yield from self._write(t, i, "rolls back DISPATCHED->SCHEDULED", ok, new, end, end)
        elif i in WORKERS:
            yield from self._worker(s, i, phase, msg)
        elif i == RECON:
            yield from self._reconciler(s, phase)

    def _worker(self, s: St, i: int, phase: Phase, msg: Msg | None) -> Iterator[Step]:
        rec, kind = s[0], phase[0]
        if kind == "gate" and msg is not None:
            runs: tuple[int, ...] = phase[1]
            att, tickets = msg[0], set(msg[1]) | set(runs)
            run, t = self._fresh(s)
            mine = tuple(sorted({*runs, run}))
            body = ("body", run, att)
            retry = ("gate", mine)
            back = ("sendback", mine)
            if (
                rec is not None
                and rec[0] in (S, D)
                and (rec[2] == att or not self.rules.gate_checks_attempt)
            ):
                yield from self._write(
                    t,
                    i,
                    f"gate CAS {rec[0].value}->RUNNING run{run}",
                    True,
                    (R, run, rec[2], run),
                    body,
                    retry,
                    back,
                )
            elif rec is not None and rec[0] is R and rec[3] in tickets:
                if self.rules.send_back_tickets_need_takeover:
                    yield from self._write(
                        t,
                        i,
                        f"take-over CAS RUNNING run{rec[3]}->RUNNING run{run}",
                        True,
                        (R, run, rec[2], run),
                        body,
                        retry,
                        back,
                    )
                else:
                    yield (
                        f"{NAMES[i]} holds ticket run{rec[3]}: owns the run outright",
                        self._set(s, i, ("body", rec[3], att)),
                        None,
                    )
            else:
                yield (
                    f"{NAMES[i]} gate: {show(rec)} -> suppressed, ack",
                    self._set(s, i, IDLE, None),
                    None,
                )
        elif kind == "sendback" and msg is not None:
            copy: Msg = (msg[0], tuple(sorted(set(msg[1]) | set(phase[1]))))
            label = f"{NAMES[i]} sends back m(att{copy[0]}, tickets {list(copy[1])})"
            yield f"{label}: ok, ack", self._queue(self._set(s, i, IDLE, None), copy), None
            if self._faults_left(s):
                again = self._fault(self._set(s, i, ("gate", phase[1])))
                yield f"{label}: refused, nothing sent; tries again", again, None
                yield (
                    f"{label}: refused, but it landed; tries again",
                    self._queue(again, copy),
                    None,
                )
        elif kind == "body":
            starts = list(s[3])
            starts[phase[2]] += 1
            bad = None
            if starts[phase[2]] > 1:
                bad = f"S1: the body of attempt {phase[2]} starts a second time"
            t = (*s[:3], tuple(starts), *s[4:])
            yield (
                f"{NAMES[i]} BODY STARTS (attempt {phase[2]})",
                self._set(t, i, ("after", phase[1], phase[2])),
                bad,
            )
        elif kind == "after":
            run = phase[1]
            holds = rec is not None and rec[0] is R and rec[3] == run
            rev, t = self._fresh(s)
            new = (OK, rev, rec[2], run) if rec is not None else None
            yield from self._write(
                t, i, f"CAS RUNNING run{run}->SUCCEEDED, ack", holds, new, ACK, ACK
            )
            if s[7] < self.bounds.retries and rec is not None:
                t = (*t[:7], t[7] + 1, t[8])
                nxt = rec[2] + 1
                yield from self._write(
                    t,
                    i,
                    f"retry CAS RUNNING run{run}->DISPATCHED att{nxt}",
                    holds,
                    (D, rev, nxt, 0),
                    ("pub", nxt, nxt, ACK, rev),
                    ACK,
                )

    def _reconciler(self, s: St, phase: Phase) -> Iterator[Step]:
        rec, kind = s[0], phase[0]
        if kind == "idle" and rec is not None and rec[0] in (S, D, R) and s[6] < self.bounds.passes:
            t = (*s[:6], s[6] + 1, *s[7:])
            yield f"R lists {show(rec)} as stale", self._set(t, RECON, ("listed", *rec[:3])), None
        elif kind == "listed":
            _, state, rev, att = phase
            ok = (
                rec is not None
                and rec[0] is state
                and (rec[1] == rev or not self.rules.reconciler_uses_rev_cas)
            )
            new_rev, t = self._fresh(s)
            now_att = rec[2] if rec is not None else att
            if state is S:
                yield from self._write(
                    t,
                    RECON,
                    "replay CAS SCHEDULED->DISPATCHED",
                    ok,
                    (D, new_rev, now_att, 0),
                    ("pub", att, now_att, IDLE, new_rev),
                    IDLE,
                )
            else:
                yield from self._write(
                    t,
                    RECON,
                    f"CAS {state.value}->TIMEOUT",
                    ok,
                    (TO, new_rev, now_att, rec[3] if rec else 0),
                    IDLE,
                    IDLE,
                )


#: Where a phase holds ids (revs, run ids): index -> "id", "ids" (a tuple) or "phase".
_IDS: dict[str, tuple[tuple[int, str], ...]] = {
    "claimed": ((1, "id"),),
    "late": ((1, "id"),),
    "pub": ((3, "phase"), (4, "id")),
    "rollback": ((1, "id"),),
    "gate": ((1, "ids"),),
    "sendback": ((1, "ids"),),
    "body": ((1, "id"),),
    "after": ((1, "id"),),
    "listed": ((2, "id"),),
    "check": ((1, "key"), (2, "phase"), (3, "phase"), (4, "phase")),
}


def canonical(s: St) -> St:
    """``s`` with its ids renumbered in order of appearance: ids are only compared."""
    ids: dict[int, int] = {0: 0}
    one = ids.setdefault

    def phase(p: Phase | None) -> Phase | None:
        where = None if p is None else _IDS.get(p[0])
        if where is None:
            return p
        assert p is not None
        out = list(p)
        for n, kind in where:
            x = p[n]
            if kind == "id":
                out[n] = None if x is None else one(x, len(ids))
            elif kind == "ids":
                out[n] = tuple(sorted(one(y, len(ids)) for y in x))
            elif kind == "key":
                out[n] = (x[0], one(x[1], len(ids)))
            else:
                out[n] = phase(x)
        return tuple(out)

    def msg(m: Msg) -> Msg:
        return m if not m[1] else (m[0], tuple(sorted(one(y, len(ids)) for y in m[1])))

    rec = s[0]
    if rec is not None:
        rec = (rec[0], one(rec[1], len(ids)), rec[2], one(rec[3], len(ids)))
    actors = tuple((phase(p), None if m is None else msg(m)) for p, m in s[1])
    queue = tuple(sorted(msg(m) for m in s[2]))
    return (rec, actors, queue, *s[3:8], len(ids))  # type: ignore[return-value]


def search(model: Model, limit: int = 2_000_000) -> Result:
    """Breadth first from the initial state; stops at the first violation."""
    start = model.initial()
    parent: dict[St, St | None] = {start: None}
    todo: deque[St] = deque([start])
    stuck: list[str] = []
    while todo:
        s = todo.popleft()
        moved = False
        for _, raw, bad in model.steps(s):
            moved = True
            nxt = canonical(raw)
            if bad is not None:
                return Result(len(parent), bad, _replay(model, _path(parent, s), nxt), model.edges)
            if nxt not in parent:
                parent[nxt] = s
                todo.append(nxt)
                if len(parent) > limit:
                    raise RuntimeError(f"more than {limit} states: tighten the bounds")
        if not moved and s[0] is not None and not s[0][0].terminal and s[0][0] not in (S, D, R):
            stuck.append(f"V: quiescent in {show(s[0])}, which no actor acts on")
    return Result(len(parent), None, [], model.edges, stuck)


def _path(parent: dict[St, St | None], s: St) -> list[St]:
    path: list[St] = []
    cur: St | None = s
    while cur is not None:
        path.append(cur)
        cur = parent[cur]
    return path[::-1]


def _replay(model: Model, path: list[St], last: St) -> list[str]:
    """The path's steps, taken again from the initial state without renumbering,
    so that each id in the trace names one rev or run throughout."""
    raw, trace = model.initial(), []
    for target in [*path[1:], last]:
        final = target is last
        for label, nxt, bad in model.steps(raw):
            if canonical(nxt) == target and (bad is not None) == final:
                trace.append(f"{label} | {show(nxt[0])}" + (f"  <- {bad}" if bad else ""))
                raw = nxt
                break
    return trace
