"""The steps of the model's workers (``acks_late``): the gate, send-back, body and outcome.

What it holds: :class:`Workers`. A worker holds the message it received until
it acks it. The gate: the CAS ``SCHEDULED`` or ``DISPATCHED → RUNNING`` on
the message's attempt under a fresh run_id; with the job ``RUNNING`` under
one of the delivery's tickets, the take-over ``RUNNING → RUNNING`` from that
run_id; with no record, the adoption of a message without our headers
(create-if-absent ``RUNNING``), never of one with them; anything else is
acked unrun. A gate write that cannot be read back sends the delivery back:
a copy carrying as tickets every run id it may have written. The body (S1
counts its starts per attempt), then the outcome on the run_id (carried: the
message acked first, the outcome written in a later step, or lost if the
worker crashes in between), or one Celery retry: ``RUNNING → DISPATCHED``
(attempt + 1, then its publish) or, for delayed jobs, ``RUNNING → PENDING``
(a countdown). S4: an outcome or a retry applies only for the run that holds
``RUNNING``.
"""

from __future__ import annotations

from collections.abc import Iterator

from ._table import State
from .base import ACK, IDLE, Base
from .world import D, Msg, P, Phase, R, Rec, S, St, Step, show, show_msg


class Workers(Base):
    """Workers with ``acks_late``."""

    def worker(self, s: St, i: int, phase: Phase, msg: Msg | None) -> Iterator[Step]:
        kind = phase[0]
        if kind == "gate" and msg is not None:
            yield from self._gate(s, i, phase[1], msg)
        elif kind == "sendback" and msg is not None:
            copy: Msg = (msg[0], tuple(sorted(set(msg[1]) | set(phase[1]))), msg[2])
            label = f"{self.who(i)} sends back {show_msg(copy)}"
            yield f"{label}: ok, ack", self.enqueue(self.put(s, i, ACK), copy), None
            if self.faults_left(s):
                again = self.fault(self.put(s, i, ("gate", phase[1])))
                yield f"{label}: refused, nothing sent; tries again", again, None
                landed = self.enqueue(again, copy)
                yield f"{label}: refused, but it landed; tries again", landed, None
        elif kind == "requeue" and msg is not None:  # the dropped read-back: back as it came
            back = self.enqueue(self.put(s, i, IDLE, None), msg)
            yield f"{self.who(i)} requeues {show_msg(msg)} unrun", back, None
        elif kind == "body":
            _, run, att = phase
            starts = list(s.starts)
            starts[att] += 1
            bad = f"S1: the body of attempt {att} starts a second time" if starts[att] > 1 else None
            t = s._replace(starts=tuple(starts))
            label = f"{self.who(i)} BODY STARTS (attempt {att})"
            yield label, self.put(t, i, ("after", run, att)), bad
        elif kind == "after":
            yield from self._after(s, i, phase[1])
        elif kind == "carried":
            yield from self._outcome(s, i, phase[1], phase[2], acks=False)

    def _gate(self, s: St, i: int, runs: tuple[int, ...], msg: Msg) -> Iterator[Step]:
        rec, who = s.rec, self.who(i)
        att, tickets, ours = msg[0], set(msg[1]) | set(runs), msg[2]
        run, t = self.fresh(s)
        same = rec is not None and (rec[2] == att or not self.rules.gate_checks_attempt)
        if rec is None and ours and self.rules.gate_adopts_headerless_only:
            yield (
                f"{who} gate: no record, our headers -> not run (record_lost), ack",
                self.put(s, i, ACK),
                None,
            )
        elif rec is None:
            what = f"gate: no record, adopts it (create-if-absent RUNNING run{run})"
            yield from self._gate_write(t, i, what, (R, run, att, run), runs, att)
        elif rec[0] in (S, D) and same:
            what = f"gate CAS {rec[0].value}->RUNNING run{run}"
            yield from self._gate_write(t, i, what, (R, run, rec[2], run), runs, att)
        elif rec[0] is R and rec[3] in tickets and same:
            if self.rules.send_back_tickets_need_takeover:
                what = f"take-over CAS RUNNING run{rec[3]}->RUNNING run{run}"
                yield from self._gate_write(t, i, what, (R, run, rec[2], run), runs, att)
            else:
                yield (
                    f"{who} holds ticket run{rec[3]}: owns the run outright",
                    self.put(s, i, ("body", rec[3], att)),
                    None,
                )
        else:
            yield f"{who} gate: {show(rec)} -> suppressed, ack", self.put(s, i, ACK), None

    def _gate_write(
        self, s: St, i: int, what: str, new: Rec, runs: tuple[int, ...], att: int
    ) -> Iterator[Step]:
        """The gate's write under a fresh run_id (``new[3]``): the body if it applied.

        An error is settled by reading back the run_id; one the store cannot
        answer sends the delivery back with its run ids as tickets. Without the
        read-back, an error requeues the delivery as it came (no ticket for
        this run).
        """
        assert new is not None
        mine = tuple(sorted({*runs, new[3]}))
        body: Phase = ("body", new[3], att)
        if not self.rules.gate_reads_back_its_write:
            yield from self.write(s, i, what, True, new, body, ("requeue",), readback=False)
            return
        yield from self.write(
            s, i, what, True, new, body, ("gate", mine), unreach=("sendback", mine)
        )

    def _holds(self, s: St, i: int, run: int) -> tuple[bool, str | None]:
        """Whether run ``run`` of worker ``i`` may write over the record; what S4 says if it
        may without holding it."""
        rec = s.rec
        holds = (
            rec is not None
            and rec[0] is R
            and (rec[3] == run or not self.rules.outcome_checks_run_id)
        )
        stolen = None
        if holds and rec is not None and rec[3] != run:
            stolen = f"S4: {self.who(i)} (run{run}) writes over a run it does not hold"
        return holds, stolen

    def _outcome(self, s: St, i: int, run: int, outcome: State, *, acks: bool) -> Iterator[Step]:
        """The outcome's CAS on the run_id, as the record is now (``acks``: and the ack)."""
        holds, stolen = self._holds(s, i, run)
        rev, t = self.fresh(s)
        now = s.rec[2] if s.rec is not None else 0
        what = f"CAS RUNNING run{run}->{outcome.value}" + (", ack" if acks else "")
        yield from self.write(t, i, what, holds, (outcome, rev, now, 0), ACK, ACK, bad=stolen)

    def _after(self, s: St, i: int, run: int) -> Iterator[Step]:
        rec = s.rec
        holds, stolen = self._holds(s, i, run)
        now = rec[2] if rec is not None else 0
        for outcome in self.scenario.outcomes:  # (each a branch of the search)
            if self.scenario.carried:  # acked as the task returns; the outcome written later
                label = f"{self.who(i)} acks; carries its outcome {outcome.value}"
                yield label, self.put(s, i, ("carried", run, outcome), None), None
            else:
                yield from self._outcome(s, i, run, outcome, acks=True)
        rev, t = self.fresh(s)
        if s.retries >= self.bounds.retries or rec is None:
            return
        t = t._replace(retries=t.retries + 1)
        nxt = now + 1
        label = f"retry CAS RUNNING run{run}->DISPATCHED att{nxt}"
        yield from self.redispatch(t, i, label, holds, rev, nxt, nxt, ACK, bad=stolen)
        if self.delayed:
            yield from self.write(
                t,
                i,
                f"retry with a countdown: CAS RUNNING run{run}->PENDING att{nxt}",
                holds,
                (P, rev, nxt, 0),
                ACK,
                ACK,
                bad=stolen,
            )
