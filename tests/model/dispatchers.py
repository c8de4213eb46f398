"""The steps of the model's dispatchers: beat nodes, sweepers and the caller.

What it holds: :class:`Dispatchers`, the steps of

* a beat node (``D``): it claims the occurrence (create-if-absent
  ``SCHEDULED``) under the store epoch it holds, unless that epoch was born
  after the slot fell due (the floor); a claim under another epoch is
  refused (the store lost its data) and the slot is skipped. A claim that
  failed and cannot be read back is tried again at the next tick;
* a sweeper (``D``, delayed jobs): CAS ``PENDING → SCHEDULED`` on the state,
  never read back (a claim applied unseen is the reconciler's to replay);
* every dispatch: CAS ``SCHEDULED → DISPATCHED`` on the claimed rev, then
  the publish (in :mod:`.base`);
* the caller (``U``): a delayed submit (create-if-absent ``PENDING``; a
  resubmission finding the job ``SCHEDULED`` dispatches it), ``cancel()``
  (``PENDING`` or ``SCHEDULED → CANCELLED`` on the state), and the submit
  of a gated job (the record created ``DISPATCHED`` with its message in one
  write, or the record, then the publish; an answer lost and not read back
  raises ``SubmitAmbiguous``: the caller submits again, and a resubmission
  that finds the job ``DISPATCHED`` with no proof its message left publishes
  it again).
"""

from __future__ import annotations

from collections.abc import Iterator

from .base import DONE, Base
from .world import C, D, P, Phase, S, St, Step, show


class Dispatchers(Base):
    """Beat nodes, sweepers and the caller."""

    def dispatcher(self, s: St, i: int, phase: Phase) -> Iterator[Step]:
        kind = phase[0]
        if kind == "start":
            yield from self._claim(s, i, phase[1])
        elif kind == "sweep":
            yield from self._sweep(s, i)
        elif kind == "claimed":
            yield from self._dispatch(s, i, phase[1], phase[2])
        elif kind == "late":  # the dropped rule: the DISPATCHED write after the publish
            rec, (_, claimed, end) = s.rec, phase
            rev, t = self.fresh(s)
            ok = rec is not None and rec[0] is S and rec[1] == claimed
            new = (D, rev, rec[2], 0) if rec is not None else None
            yield from self.write(t, i, "CAS SCHEDULED->DISPATCHED", ok, new, end, end)
        elif kind == "submit":
            yield from self._submit(s, i)
        elif kind == "cancel":
            rec = s.rec
            rev, t = self.fresh(s)
            ok = rec is not None and rec[0] in (P, S)
            new = (C, rev, rec[2], 0) if rec is not None else None
            was = rec[0].value if rec is not None else "-"
            yield from self.write(t, i, f"cancel(): CAS {was}->CANCELLED", ok, new, DONE, DONE)
        elif kind == "enqueue":
            yield from self._enqueue(s, i)

    def _claim(self, s: St, i: int, held: int | None) -> Iterator[Step]:
        who = self.who(i)
        if held is None:
            yield f"{who} starts, reads epoch {s.losses}", self.put(s, i, ("start", s.losses)), None
            return
        if held and self.rules.claims_respect_floor:
            yield (
                f"{who} skips the slot: epoch {held} was born after it fell due (floor)",
                self.put(s, i, DONE),
                None,
            )
            return
        if self.rules.claims_carry_epoch and held != s.losses:
            yield (
                f"{who} claims under epoch {held}: refused, the store's is {s.losses} "
                "(loss counted, slot skipped)",
                self.put(s, i, DONE),
                None,
            )
            return
        rev, t = self.fresh(s)
        retry = ("start", held)  # the next tick tries an undecided slot again
        yield from self.write(
            t,
            i,
            f"claims under epoch {held} (create-if-absent SCHEDULED)",
            s.rec is None,
            (S, rev, 0, 0),
            ("claimed", rev, DONE),
            DONE,
            again=retry,
            unreach=retry,
        )

    def _sweep(self, s: St, i: int) -> Iterator[Step]:
        rec = s.rec
        if rec is None or rec[0] is not P:
            return
        rev, t = self.fresh(s)
        yield from self.write(
            t,
            i,
            "sweeps: CAS PENDING->SCHEDULED",
            True,
            (S, rev, rec[2], 0),
            ("claimed", rev, self.home),
            self.home,
            readback=False,
        )

    def _dispatch(self, s: St, i: int, claimed: int, end: Phase) -> Iterator[Step]:
        rec = s.rec
        att = rec[2] if rec is not None else 0
        if not self.rules.dispatched_written_before_publish:
            yield from self.publish(s, i, att, None, ("late", claimed, end), None)
            return
        rev, t = self.fresh(s)
        ok = rec is not None and rec[0] is S and rec[1] == claimed
        new = (D, rev, att, 0) if rec is not None else None
        yield from self.write(
            t, i, "CAS SCHEDULED->DISPATCHED", ok, new, ("pub", att, att, end, rev), end
        )

    def _submit(self, s: St, i: int) -> Iterator[Step]:
        rec, who = s.rec, self.who(i)
        after: Phase = ("cancel",)
        if rec is None:
            rev, t = self.fresh(s)
            yield from self.write(
                t,
                i,
                "submits a delayed job (create-if-absent PENDING)",
                True,
                (P, rev, 0, 0),
                after,
                after,
                again=("submit",),
                unreach=("submit",),
            )
        elif rec[0] is S:  # a resubmission dispatches a job still SCHEDULED
            yield (
                f"{who} submits again: finds {show(rec)}, dispatches it",
                self.put(s, i, ("claimed", rec[1], after)),
                None,
            )
        else:
            yield (
                f"{who} submits again: finds {show(rec)}, which stands",
                self.put(s, i, after),
                None,
            )

    def _enqueue(self, s: St, i: int) -> Iterator[Step]:
        rev, t = self.fresh(s)
        again = ("enqueue",)  # SubmitAmbiguous: the caller submits again
        one, rec = self.scenario.one_write, s.rec
        if rec is not None and rec[0] is D and not one and self.rules.resubmit_republishes:
            yield from self.write(
                t,
                i,
                f"submits again: finds {show(rec)}, no proof its message left: "
                "CAS DISPATCHED->DISPATCHED, to publish again",
                True,
                (D, rev, rec[2], 0),
                ("pub", rec[2], rec[2], DONE, rev),
                DONE,
                again=again,
                unreach=again,
            )
            return
        yield from self.write(
            t,
            i,
            "submits in one step: record DISPATCHED and message (if absent)"
            if one
            else "submits: creates the record DISPATCHED (if absent), to publish after",
            rec is None,
            (D, rev, 0, 0),
            DONE if one else ("pub", 0, 0, DONE, rev),
            DONE,
            again=again,
            unreach=again,
            message=(0, (), True) if one else None,
            edges=((None, S), (S, D)),  # its history: the create, then the dispatch
        )
