"""The steps of the model's atomic workers: gate, body's effects and outcome in one transaction.

What it holds: :class:`Atomic`. The worker begins a transaction on the store's
database and takes the record's row lock (a worker that finds it taken
waits, as does any other writer: :meth:`Base.write`); inside it the gate's
CAS ``SCHEDULED`` or ``DISPATCHED → RUNNING`` on the message's attempt, the
body (its effects: writes to the same database), and the outcome, then the
commit: the record ``SUCCEEDED`` and the effects appear together. Until the
commit others read the record as it was. A crash, a failed commit or a body
that raises rolls everything back (the lock released, no effect, the
record as it was); a failed body then ends the job ``FAILED`` in a
transaction of its own. A commit whose answer is lost is read back; as a
crash would, it may also have been rolled back: the delivery goes back
unrun. The body may start again at the same attempt: what must hold is E1
to E3 (:class:`~tests.model.world.Scenario`), not S1.

The two rules a variant drops: ``atomic_running_in_transaction`` (the gate's
``RUNNING`` committed before the body: a crash in the body leaves the job
``RUNNING`` with nothing committed, and a redelivery is refused at the
gate) and ``atomic_outcome_with_effects`` (the effects committed with
``RUNNING``, the outcome written after them: a crash in between leaves a
``RUNNING`` job whose effects committed).
"""

from __future__ import annotations

from collections.abc import Iterator

from ._table import State
from .base import ACK
from .workers import Workers
from .world import OK, D, Msg, Phase, R, S, St, Step, show, show_msg

#: The atomic worker's phases (besides the gate, which both kinds of worker have).
PHASES = frozenset({"begin", "tx", "commit", "committed", "failed"})


class Atomic(Workers):
    """Workers that run the job atomically where ``Scenario.atomic`` says so."""

    def worker(self, s: St, i: int, phase: Phase, msg: Msg | None) -> Iterator[Step]:
        if not self.scenario.atomic:
            yield from super().worker(s, i, phase, msg)
        elif phase[0] == "gate" and msg is not None:
            yield from self.atomic_gate(s, i, msg)
        elif phase[0] in PHASES:
            yield from self.atomic(s, i, phase, msg)
        else:  # a send-back, a requeue
            yield from super().worker(s, i, phase, msg)

    def atomic_gate(self, s: St, i: int, msg: Msg) -> Iterator[Step]:
        rec, who, att = s.rec, self.who(i), msg[0]
        if s.lock:  # another worker's transaction holds the row: this one waits for it
            return
        if rec is None or rec[0] not in (S, D) or rec[2] != att:
            yield f"{who} gate: {show(rec)} -> suppressed, ack", self.put(s, i, ACK), None
            return
        run, t = self.fresh(s)
        if self.rules.atomic_running_in_transaction:
            label = f"{who} begins, locks the row: gate CAS {rec[0].value}->RUNNING run{run}"
            locked = self.put(t._replace(lock=i + 1), i, ("tx", run, att))
            yield f"{label} (uncommitted)", locked, None
            return
        what = f"gate CAS {rec[0].value}->RUNNING run{run} (committed)"
        mine = (run,)
        new = (R, run, att, run)
        yield from self.write(t, i, what, True, new, ("begin", run, att), ("gate", mine))

    def atomic(self, s: St, i: int, phase: Phase, msg: Msg | None) -> Iterator[Step]:
        kind, who = phase[0], self.who(i)
        if kind == "begin":  # (the variant: RUNNING committed, then the transaction)
            if not s.lock:
                label = f"{who} begins, locks the row"
                yield label, self.put(s._replace(lock=i + 1), i, ("tx", *phase[1:])), None
        elif kind == "tx":
            _, run, att = phase
            starts = list(s.starts)
            starts[att] += 1
            t = s._replace(starts=tuple(starts))
            yield f"{who} BODY STARTS (attempt {att})", self.put(t, i, ("commit", run, att)), None
        elif kind == "commit":
            yield from self._commit(s, i, phase[1], phase[2], msg)
        elif kind == "committed":  # (the variant: the outcome written apart)
            yield from self._apart(s, i, phase[1])
        elif kind == "failed":
            yield from self._failed(s, i, phase[1])

    def _commit(self, s: St, i: int, run: int, att: int, msg: Msg | None) -> Iterator[Step]:
        """The body returned: the commit, or the body raised: the rollback."""
        who, rec = self.who(i), s.rec
        free = s._replace(lock=0)
        if State.FAILED in self.scenario.outcomes:
            yield f"{who} body raises: rolls back", self.put(free, i, ("failed", att)), None
        assert rec is not None  # the row is locked: nobody wrote it since the gate
        effects = s.effects + 1
        bad = f"E1: the job's effects commit a second time (attempt {att})" if effects > 1 else None
        if not self.rules.atomic_outcome_with_effects:
            self.edges.add((rec[0], R))
            mine = (R, run, att, run)
            t = free._replace(rec=mine, effects=effects)
            label = f"{who} commits the effects, RUNNING run{run}"
            yield label, self.put(t, i, ("committed", run)), bad
            return
        rev, t = self.fresh(free)
        holds = rec[0] in (S, D) or (rec[0] is R and rec[3] == run)
        if not holds:  # (the variant: RUNNING committed, then taken over) the CAS is refused
            yield f"{who} outcome CAS refused: rolls back, ack", self.put(t, i, ACK), None
            return
        if rec[0] is not R:
            self.edges.add((rec[0], R))
        self.edges.add((R, OK))
        done = t._replace(rec=(OK, rev, att, 0), ended=OK, effects=effects)
        bad = bad or self.ended_problem(OK, effects)
        yield f"{who} CAS RUNNING run{run}->SUCCEEDED, commits, ack", self.put(done, i, ACK), bad
        if self.faults_left(s) and msg is not None:
            back = self.enqueue(self.fault(self.put(t, i, ACK)), msg)
            yield f"{who} commit fails, rolled back: sends {show_msg(msg)} back unrun", back, None

    def _apart(self, s: St, i: int, run: int) -> Iterator[Step]:
        """The variant's outcome, on the run_id, after the effects committed."""
        holds, stolen = self._holds(s, i, run)
        rev, t = self.fresh(s)
        now = s.rec[2] if s.rec is not None else 0
        what = f"CAS RUNNING run{run}->SUCCEEDED, ack"
        yield from self.write(t, i, what, holds, (OK, rev, now, 0), ACK, ACK, bad=stolen)

    def _failed(self, s: St, i: int, att: int) -> Iterator[Step]:
        """After the rollback: the job ``FAILED``, in a transaction of its own."""
        rec = s.rec
        rev, t = self.fresh(s)
        ok = rec is not None and rec[0] in (S, D) and rec[2] == att
        state = rec[0] if rec is not None else D
        edges = [(state, R), (R, State.FAILED)]
        what = f"CAS {state.value}->RUNNING->FAILED att{att}, commits"
        new = (State.FAILED, rev, att, 0)
        yield from self.write(t, i, what, ok, new, ACK, ACK, edges=edges)
