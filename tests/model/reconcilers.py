"""The steps of the model's reconcilers: list a stale job, then act on what was listed.

What it holds: :class:`Reconcilers`. A reconciler may find the job stale at
any moment (timeouts are not modelled: the worst case), or, where L is
checked, only once no other step can move the job (its timeouts are then
accurate). It acts later, with a CAS on the rev it listed:

* ``SCHEDULED``: replayed through the dispatch path; for delayed jobs also
  ``FAILED`` (replays exhausted) or ``CANCELLED`` (past the deadline);
* ``DISPATCHED``: ``TIMEOUT``; opted in, redispatched (``DISPATCHED →
  DISPATCHED``, then the publish of the record it wrote); an atomic job is
  always redispatched, never timed out;
* ``RUNNING``: ``TIMEOUT``; opted in, re-run (``RUNNING → DISPATCHED``, the
  next attempt, then its publish).

Two reconcilers race when their passes overlap (a lease that lapsed): the
model lets them, each write still a CAS on its own listing. Their lease is
not modelled, since the rev is what keeps a write off a job that moved.
L: where checked, a job that times out had its attempt's body started.
"""

from __future__ import annotations

from collections.abc import Iterator

from .base import IDLE, Base
from .world import C, D, F, Phase, R, S, St, Step, T, show


class Reconcilers(Base):
    """One reconciler, or two whose passes overlap."""

    def listing(self, s: St, i: int) -> Iterator[Step]:
        rec = s.rec
        if rec is not None and rec[0] in (S, D, R) and s.passes < self.bounds.passes:
            t = s._replace(passes=s.passes + 1)
            label = f"{self.who(i)} lists {show(rec)} as stale"
            yield label, self.put(t, i, ("listed", *rec[:3])), None

    def reconcile(self, s: St, i: int, phase: Phase) -> Iterator[Step]:
        rec = s.rec
        _, state, rev, att = phase
        ok = (
            rec is not None
            and rec[0] is state
            and (rec[1] == rev or not self.rules.reconciler_uses_rev_cas)
        )
        new_rev, t = self.fresh(s)
        now = rec[2] if rec is not None else att
        if state is S:
            label = "replay CAS SCHEDULED->DISPATCHED"
            yield from self.redispatch(t, i, label, ok, new_rev, now, att, IDLE)
            if self.delayed:
                for to, why in ((F, "replays exhausted"), (C, "deadline passed")):
                    yield from self.write(
                        t,
                        i,
                        f"{why}: CAS SCHEDULED->{to.value}",
                        ok,
                        (to, new_rev, now, 0),
                        IDLE,
                        IDLE,
                    )
            return
        if state is D and self.scenario.atomic:  # nothing of a run can have committed
            label = "redispatch CAS DISPATCHED->DISPATCHED"
            yield from self.redispatch(t, i, label, ok, new_rev, now, att, IDLE)
            return
        lost = None
        if self.scenario.liveness and s.starts[now] == 0:
            lost = (
                f"L: the job times out at attempt {now}, whose body never started, "
                "with no crash and no lost message"
            )
        yield from self.write(
            t, i, f"CAS {state.value}->TIMEOUT", ok, (T, new_rev, now, 0), IDLE, IDLE, bad=lost
        )
        if not self.scenario.rerun:
            return
        if state is D:
            label = "redispatch CAS DISPATCHED->DISPATCHED"
            yield from self.redispatch(t, i, label, ok, new_rev, now, att, IDLE)
        else:
            label = f"re-run CAS RUNNING->DISPATCHED att{now + 1}"
            yield from self.redispatch(t, i, label, ok, new_rev, now + 1, att + 1, IDLE)
