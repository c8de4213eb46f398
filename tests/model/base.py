"""What every actor of the model shares: the layout, the initial state, writes and publishes.

What it holds: :class:`Base`, which lays the actors out for a scenario, builds
the initial state, and makes the two kinds of effect every actor has: a
conditional store write (:meth:`Base.write`: applied, refused, failed before
it applied, or applied and then timed out, the writer then reading back) and
a publish (:meth:`Base.publish`: ok, ambiguous, definite, or "definite" but
landed). S2 (a terminal state never changes, also across a store loss) and
S3 (a publish follows the publisher's own acknowledged write for its attempt)
are checked here; the actors' own steps are in the modules that subclass it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from ._table import State
from .world import (
    ACK,
    DONE,
    IDLE,
    LAYOUTS,
    Bounds,
    D,
    Msg,
    Phase,
    Rec,
    Rules,
    Scenario,
    St,
    Step,
    show_msg,
)

_KEEP: Msg = (-1, (), False)  # "the actor keeps the message it holds"
_new = tuple.__new__  # a state from a plain tuple, faster than NamedTuple._replace


class Base:
    """The actors' layout and their shared effects, under ``rules`` and within ``bounds``."""

    def __init__(
        self,
        rules: Rules | None = None,
        scenario: Scenario | None = None,
        bounds: Bounds | None = None,
    ) -> None:
        self.rules = rules or Rules()
        self.scenario = scenario or Scenario()
        self.bounds = bounds or Bounds()
        self.edges: set[tuple[State | None, State]] = set()
        kinds = LAYOUTS[self.scenario.start] + "R" * self.bounds.reconcilers
        self.kinds = kinds
        names, seen = [], {k: 0 for k in kinds}
        for k in kinds:
            seen[k] += 1
            alone = kinds.count(k) == 1
            names.append(k if alone else f"{k}{seen[k]}")
        self.names = tuple(names)
        self.workers = tuple(i for i, k in enumerate(kinds) if k == "W")
        self.delayed = self.scenario.start == "delayed"
        #: Where a dispatcher goes once its dispatch is over (sweepers sweep again).
        self.home: Phase = ("sweep",) if self.delayed else DONE

    def initial(self) -> St:
        first = {
            "D": ("sweep",) if self.delayed else ("start", 0),
            "U": ("submit",) if self.delayed else ("enqueue",),
            "W": IDLE,
            "R": IDLE,
        }
        actors = tuple((first[k], None) for k in self.kinds)
        queue: tuple[Msg, ...] = ((0, (), False),) if self.scenario.start == "foreign" else ()
        attempts = self.bounds.retries + self.bounds.passes + 2
        return St(None, actors, queue, (0,) * attempts, 0, 0, 0, 0, 0, None, 1, 0, 0)

    # --- helpers: each returns a new state ------------------------------------------

    @staticmethod
    def put(s: St, i: int, phase: Phase, msg: Msg | None = _KEEP) -> St:
        """``s`` with actor ``i`` in ``phase`` (``ACK``: idle, its message acked)."""
        actors = list(s.actors)
        if phase == ACK:
            phase, msg = IDLE, None
        actors[i] = (phase, actors[i][1] if msg is _KEEP else msg)
        return _new(St, (s[0], tuple(actors), *s[2:]))

    @staticmethod
    def fresh(s: St) -> tuple[int, St]:
        """A fresh id, and ``s`` past it."""
        return s[10], _new(St, (*s[:10], s[10] + 1, *s[11:]))

    @staticmethod
    def fault(s: St) -> St:
        return _new(St, (*s[:4], s[4] + 1, *s[5:]))

    @staticmethod
    def enqueue(s: St, msg: Msg) -> St:
        return _new(St, (s[0], s[1], tuple(sorted((*s[2], msg))), *s[3:]))

    def faults_left(self, s: St) -> bool:
        return s.faults < self.bounds.faults

    def who(self, i: int) -> str:
        return self.names[i]

    # --- the two effects ----------------------------------------------------------------

    def write(
        self,
        s: St,
        i: int,
        what: str,
        ok: bool,
        new: Rec,
        yes: Phase,
        no: Phase,
        *,
        unreach: Phase | None = None,
        again: Phase | None = None,
        readback: bool = True,
        message: Msg | None = None,
        bad: str | None = None,
        edges: Iterable[tuple[State | None, State]] = (),
    ) -> Iterator[Step]:
        """A conditional write by actor ``i``: applied, refused, or failed either way.

        ``no``: refused, or (without ``again``) read back as not applied;
        ``unreach``: the read-back cannot reach the store (``None``: it always
        can); ``readback=False``: a failed write is not read back (``no`` either
        way); ``message``: queued in the same atomic step; ``bad``: the property
        the write breaks if it applies; ``edges``: recorded instead of the write's.
        """
        if s.lock and s.lock != i + 1:
            return  # a worker's transaction holds the record's row: the write waits for it
        who = f"{self.who(i)} {what}"
        if not ok:
            yield f"{who}: refused", self.put(s, i, no), None
            return
        assert new is not None
        old = s.rec
        for edge in edges or [(old[0] if old else None, new[0])]:
            self.edges.add(edge)
        if old is not None and old[0].terminal:
            bad = bad or f"S2: terminal {old[0].value} changed to {new[0].value}"
        elif old is None and s.ended is not None:
            bad = bad or f"S2: the job ended {s.ended.value}, was lost, and is now {new[0].value}"
        if new[0].terminal:
            bad = bad or self.ended_problem(new[0], s.effects)
        applied = s._replace(rec=new, ended=new[0] if new[0].terminal else s.ended)
        if message is not None:
            applied = self.enqueue(applied, message)
        yield f"{who}: ok", self.put(applied, i, yes), bad
        if not self.faults_left(s):
            return
        if new[0] is D and old is not None and not self.rules.dispatched_write_read_back:
            readback = False  # the dropped rule: a DISPATCHED write that errored fails closed
        if not readback:
            yield (
                f"{who}: applied, then the store timed out",
                self.fault(self.put(applied, i, no)),
                bad,
            )
            yield f"{who}: store error, not applied", self.fault(self.put(s, i, no)), None
            return
        key = ("run", new[3]) if new[0] is State.RUNNING else ("rev", new[1])
        check = ("check", key, yes, no if again is None else again, unreach)
        yield (
            f"{who}: applied, then the store timed out",
            self.fault(self.put(applied, i, check)),
            bad,
        )
        yield f"{who}: store error, not applied", self.fault(self.put(s, i, check)), None

    def ended_problem(self, state: State, effects: int) -> str | None:
        """E2 or E3 if an atomic job ends ``state`` with its effects committed ``effects``
        times (``None``: not atomic, or fine)."""
        if not self.scenario.atomic:
            return None
        if (state is State.SUCCEEDED) != (effects == 1) or effects > 1:
            return f"E2: the job ends {state.value} with its effects committed {effects} time(s)"
        if state is State.TIMEOUT:
            return "E3: the job times out, its effects never committed"
        return None

    def redispatch(
        self,
        s: St,
        i: int,
        what: str,
        ok: bool,
        rev: int,
        att: int,
        sent: int,
        after: Phase,
        *,
        bad: str | None = None,
    ) -> Iterator[Step]:
        """A CAS to ``DISPATCHED`` at attempt ``att`` (revision ``rev``), then a publish.

        The message carries attempt ``sent``; ``after``: the actor's phase once
        the publish is done, or when the CAS is refused.
        """
        new = (D, rev, att, 0)
        yield from self.write(s, i, what, ok, new, ("pub", sent, att, after, rev), after, bad=bad)

    def read_back(self, s: St, i: int, phase: Phase) -> Iterator[Step]:
        """Actor ``i`` reads back whether its write applied (``phase``: its ``check``)."""
        _, (field, value), yes, no, unreach = phase
        rec = s.rec
        if field == "rev":
            held = rec is not None and rec[1] == value
        else:
            held = rec is not None and rec[0] is State.RUNNING and rec[3] == value
        verdict = "applied" if held else "not applied"
        yield f"{self.who(i)} reads back: {verdict}", self.put(s, i, yes if held else no), None
        if unreach is not None and self.faults_left(s):
            yield (
                f"{self.who(i)} cannot read back (store unreachable)",
                self.fault(self.put(s, i, unreach)),
                None,
            )

    def publish(
        self, s: St, i: int, att: int, acked: int | None, after: Phase, own: int | None
    ) -> Iterator[Step]:
        """Actor ``i`` publishes attempt ``att``; ``acked``: the attempt its own
        acknowledged ``DISPATCHED`` write was for; ``own``: that write's rev."""
        msg: Msg = (att, (), True)
        who = f"{self.who(i)} publishes {show_msg(msg)}"
        bad = None
        if acked != att:
            bad = f"S3: {self.who(i)} publishes attempt {att} without its own acknowledged " + (
                "DISPATCHED write" if acked is None else f"write, which was for attempt {acked}"
            )
        yield f"{who}: ok", self.enqueue(self.put(s, i, after), msg), bad
        rec = s.rec
        if self.delayed and own is not None:  # the dispatcher checks the deadline first
            ok = rec is not None and rec[0] is D and rec[1] == own
            rev, t = self.fresh(s)
            new = (State.CANCELLED, rev, rec[2], 0) if rec is not None else None
            yield from self.write(
                t, i, "finds the deadline passed: CAS DISPATCHED->CANCELLED", ok, new, after, after
            )
        if not self.faults_left(s) or self.scenario.liveness:
            return
        f = self.fault(s)
        yield f"{who}: ambiguous, landed", self.enqueue(self.put(f, i, after), msg), bad
        yield f"{who}: ambiguous, lost", self.put(f, i, after), bad
        back = ("rollback", own, after) if own is not None else after
        yield f"{who}: definite failure", self.put(f, i, back), None
        if self.bounds.misreported_definite:
            landed = self.enqueue(self.put(f, i, back), msg)
            yield f"{who}: 'definite' failure, but it landed", landed, bad

    def rollback(self, s: St, i: int, phase: Phase) -> Iterator[Step]:
        """After a definite publish failure: ``DISPATCHED → SCHEDULED`` on the own rev."""
        _, own, end = phase
        rec = s.rec
        rev, t = self.fresh(s)
        ok = rec is not None and rec[0] is D and rec[1] == own
        new = (State.SCHEDULED, rev, rec[2], 0) if rec is not None else None
        yield from self.write(t, i, "rolls back DISPATCHED->SCHEDULED", ok, new, end, end)


__all__ = ["ACK", "DONE", "IDLE", "Base"]
