"""The model of one job's life: every step any actor, the broker or the store can take.

What it holds: :class:`Model`, which puts the actors together
(:mod:`.dispatchers`, :mod:`.workers` and :mod:`.atomic`, :mod:`.reconcilers`,
on :mod:`.base`) and adds what belongs to no one actor: crashes, deliveries, the broker's
duplicates and the store's losses. Two alike actors in one place move once
(the first stands for both), and an idle worker receives only if no worker
before it is idle.
"""

from __future__ import annotations

from collections.abc import Iterator

from .atomic import Atomic
from .base import IDLE, Base
from .dispatchers import Dispatchers
from .reconcilers import Reconcilers
from .world import D, Msg, P, Phase, R, S, St, Step, show_msg


class Model(Dispatchers, Atomic, Reconcilers, Base):
    """The steps of one job's life under ``rules``, in ``scenario``, within ``bounds``."""

    @property
    def acted_on(self) -> frozenset[object]:
        """The live states some actor moves by itself: the reconciler's, and swept ``PENDING``."""
        return frozenset({S, D, R, P} if self.delayed else {S, D, R})

    def steps(self, s: St) -> Iterator[Step]:
        if not self.scenario.liveness:
            yield from self._moves(s)
            yield from self._listings(s)
            return
        moves = list(self._moves(s))
        yield from moves
        if not moves:  # an accurate reconciler: the job is stale only once nothing moves it
            yield from self._listings(s)

    def _alike(self, s: St, i: int) -> bool:
        return i > 0 and self.kinds[i] == self.kinds[i - 1] and s.actors[i] == s.actors[i - 1]

    def _listings(self, s: St) -> Iterator[Step]:
        for i, (phase, _) in enumerate(s.actors):
            if self.kinds[i] == "R" and phase == IDLE and not self._alike(s, i):
                yield from self.listing(s, i)

    def _moves(self, s: St) -> Iterator[Step]:
        for i, (phase, msg) in enumerate(s.actors):
            if self._alike(s, i):
                continue
            kind, who = phase[0], self.kinds[i]
            if kind == "check":
                yield from self.read_back(s, i, phase)
            elif kind == "pub":
                yield from self.publish(s, i, *phase[1:])
            elif kind == "rollback":
                yield from self.rollback(s, i, phase)
            elif who == "W":
                yield from self.worker(s, i, phase, msg)
            elif who == "R":
                if kind == "listed":
                    yield from self.reconcile(s, i, phase)
            else:
                yield from self.dispatcher(s, i, phase)
            yield from self._crash(s, i, phase, msg)
        yield from self._broker(s)
        if s.losses < self.scenario.losses and s.rec is not None:
            lost = s._replace(rec=None, losses=s.losses + 1)
            yield f"THE STORE LOSES ITS DATA (new epoch {s.losses + 1})", lost, None

    def _crash(self, s: St, i: int, phase: Phase, msg: Msg | None) -> Iterator[Step]:
        if self.scenario.liveness or not self.faults_left(s):
            return
        who = self.who(i)
        if msg is not None:  # (its transaction, if it had one, rolled back)
            free = s._replace(lock=0) if s.lock == i + 1 else s
            requeued = self.enqueue(self.put(free, i, IDLE, None), msg)
            yield (
                f"{who} crashes; its unacked {show_msg(msg)} is redelivered",
                self.fault(requeued),
                None,
            )
        elif self.kinds[i] == "D" and self.scenario.losses:
            if phase != ("start", None):  # it restarts, and will read the epoch
                yield (
                    f"{who} crashes and restarts",
                    self.fault(self.put(s, i, ("start", None))),
                    None,
                )
        elif self.kinds[i] == "D" and phase[0] not in ("done", "start", "sweep"):
            yield f"{who} crashes", self.fault(self.put(s, i, self.home)), None
        elif self.kinds[i] == "W" and phase[0] == "carried":  # acked: its outcome is lost
            yield (
                f"{who} crashes with its outcome unwritten",
                self.fault(self.put(s, i, IDLE)),
                None,
            )

    def _broker(self, s: St) -> Iterator[Step]:
        actors, queue = s.actors, s.queue
        free = next((w for w in self.workers if actors[w][0] == IDLE), None)
        if free is not None:
            for n, msg in enumerate(queue):
                if n and queue[n - 1] == msg:
                    continue
                rest = s._replace(queue=queue[:n] + queue[n + 1 :])
                got = self.put(rest, free, ("gate", ()), msg)
                yield f"{self.who(free)} receives {show_msg(msg)}", got, None
        if s.dups < self.bounds.dups:
            held = [m for _, m in actors if m is not None]
            for msg in sorted(set(queue) | set(held)):
                dup = self.enqueue(s._replace(dups=s.dups + 1), msg)
                yield f"broker duplicates {show_msg(msg)}", dup, None
