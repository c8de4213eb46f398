"""Beat's claims of a tick: the planned slots claimed in batches, the won ones dispatched.

A tick's plans (:mod:`~celery_exactonce.beat.planner`) give each due entry's slots
to claim. :class:`Claimer` builds the job of each slot (signed, as it will be
dispatched), claims them in batches of :data:`CLAIM_BATCH` under the epoch
the store-loss guard holds (:func:`claims.claim`, one round trip each) and
dispatches the jobs this node won before it claims the next batch
(:meth:`Dispatcher.dispatch_many`); beat's own entries (the reconciler's) run
on beat's runner instead, if it has one. What each answer means for the node
is noted here too:

* a claim that failed on a store error leaves its slot undecided (fail
  closed): the plan records it, and the next tick inside the window tries
  again;
* a slot its entry's floor moved past (a loss found earlier in the tick), or
  whose claim the store refused for its epoch, is skipped and counted; a
  refusal also reports the loss and has the guard adopt the store's new epoch
  (on a sharded store, only the refused shards' floors move);
* a slot found claimed by another app's entry of the same name is reported
  (:mod:`~celery_exactonce.beat.conflicts`).

With Sentry Crons on (:mod:`~celery_exactonce.observe.sentry_crons`), each slot's job carries
its check-in headers, and the node that won the claim opens the check-in.

Every slot beat skips is noted through :meth:`Claimer.skipped`, but for beat's
own entries. :func:`fail_closed` records a part of a tick that a store error
stopped (the scheduler's reads and its sweep use it too).

The claimer reads the entries' policies it is handed and never calls back into
the scheduler. Not here: which slots to claim (:mod:`~celery_exactonce.beat.planner`),
how far each entry is decided, the heap and the tick
(:mod:`~celery_exactonce.beat.scheduler`), one batch's answers sorted
(:mod:`~celery_exactonce.beat.claims`), the job of a slot
(:mod:`~celery_exactonce.beat.entries`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import zlib
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Protocol

from celery_exactonce.beat import claims, entries
from celery_exactonce.beat.conflicts import ConflictWatch
from celery_exactonce.beat.entries import EntryPolicy, entry_of, fire_of
from celery_exactonce.beat.planner import Plan
from celery_exactonce.beat.skips import SkipTally
from celery_exactonce.beat.store_loss import StoreLossGuard
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.writes import NewJob
from celery_exactonce.dispatch.dispatcher import BEAT_REASON
from celery_exactonce.observe import metrics, traces
from celery_exactonce.observe.sentry_crons import Crons
from celery_exactonce.runtime import Runtime

#: Claims per ``create_many`` round trip.
CLAIM_BATCH = 500


class Runner(Protocol):
    """Where beat's own won slots run (:class:`~celery_exactonce.reconcile.task.BeatRunner`)."""

    def start(self, job: Job) -> None: ...


def fail_closed(runtime: Runtime, phase: str, what: str, exc: BaseException) -> None:
    """A store error stopped part of a tick: nothing of it was claimed or dispatched.

    The reconciler's grace starts (this process met a store error), and
    ``fail_closed`` is counted under ``phase``; the next tick tries again.
    Sentry hears of it once per burst (:data:`metrics.SENTRY_BURSTS`).
    """
    runtime.note_store_error()
    metrics.event(
        "fail_closed",
        f"{what} ({exc})",
        level=logging.WARNING,
        labels={"phase": phase},
        sentry=True,
        exc_info=exc,
    )


class Claimer:
    """Claims a tick's planned slots and dispatches the won ones (see the module docs)."""

    def __init__(
        self, runtime: Runtime, guard: StoreLossGuard, skips: SkipTally, runner: Runner | None
    ) -> None:
        self._runtime = runtime
        self._guard = guard
        self._skips = skips
        self._runner = runner
        self._conflicts = ConflictWatch(runtime.store, runtime.node)
        self._crons = Crons(runtime.app)
        self._jobs: dict[str, _Kept] = {}

    def occurrence(self, name: str, entry: Any, policy: EntryPolicy, fire: datetime) -> NewJob:
        """The job of ``entry``'s slot at ``fire`` (:func:`entries.occurrence`), signed.

        Built from the entry's job of an earlier slot while the entry and its
        policy are as they were (:meth:`NewJob.for_slot`): every node builds
        the job of every due slot, most of them to find it claimed already.
        """
        namespace, node = self._runtime.store.namespace, self._runtime.node
        kept = self._jobs.get(name)
        if kept is not None and kept.holds(entry, policy):
            new = kept.job.for_slot(
                JobRef.occurrence(entries.occurrence_id(namespace, name, fire)),
                fire,
                entries.deadline_of(policy, fire),
            )
        else:
            new = entries.occurrence(name, entry, fire, policy, namespace=namespace, node=node)
            self._jobs[name] = _Kept.of(entry, policy, new)
        if not policy.internal:
            monitor = self._crons.headers(name, entry.schedule, new.ref.id)
            if monitor is not None:  # Sentry Crons: the same headers on every publish of it
                headers = {**dict(new.options.get("headers") or {}), **monitor}
                new = dataclasses.replace(new, options={**new.options, "headers": headers})
        # Signed here, not only by the store: a won claim is dispatched as built from this.
        signer = self._runtime.signer
        return new if signer is None else signer.sign_new(new)

    def skipped(
        self,
        name: str,
        fires: list[datetime],
        where: str,
        policies: Mapping[str, EntryPolicy],
        task: str | None = None,
    ) -> None:
        """Note skipped slots of ``name`` (of ``task``, :meth:`SkipTally.note`), but for beat's
        own entries: a reconcile pass that is not needed again after downtime is no lost work.
        """
        policy = policies.get(name)
        if policy is None or not policy.internal:
            self._skips.note(name, fires, where, task)

    def claim_and_dispatch(
        self, plans: list[Plan], now: datetime, policies: Mapping[str, EntryPolicy]
    ) -> None:
        """Claim the planned slots in batches and dispatch the won ones.

        A claim that failed on a store error is recorded in its plan
        (:attr:`Plan.failed`): the caller decides the entry up to
        :meth:`Plan.decided_to`, so the next tick inside the window plans it
        again (fail closed). ``policies`` are the entries' policies, by name.
        """
        planned = [
            (plan, new) for plan in rotated(plans, self._runtime.node) for new in plan.claims
        ]
        for i in range(0, len(planned), CLAIM_BATCH):
            batch = planned[i : i + CLAIM_BATCH]
            with traces.span("exactonce.claim", root=True, jobs=len(batch)):
                won = self._claim_batch(batch, now, policies)
            if self._runner is not None:
                for job in [job for job in won if _internal(job, policies)]:
                    won.remove(job)
                    self._runner.start(job)
            if won:
                self._crons.in_progress(won)
                self._runtime.dispatcher.dispatch_many(won, reason=BEAT_REASON)

    def _claim_batch(
        self,
        batch: list[tuple[Plan, NewJob]],
        now: datetime,
        policies: Mapping[str, EntryPolicy],
    ) -> list[Job]:
        """Claim the batch (:func:`claims.claim`); the jobs this node won (``SCHEDULED``)."""
        guard = self._guard
        plans: dict[str, Plan] = {}
        provable: list[NewJob] = []
        for plan, new in batch:  # a loss found earlier in this tick moved the floor
            plans[plan.name] = plan
            if guard.provable(fire_of(new), plan.name):
                provable.append(new)
            else:
                self.skipped(
                    plan.name, [fire_of(new)], guard.reason_for(plan.name), policies, new.task
                )
        if not provable:
            return []
        claimed = claims.claim(self._runtime.store, provable, epoch=guard.epoch, now=now)
        if claimed.error is not None and claimed.failed:
            what = (
                f"{len(claimed.failed)} claim(s) failed on a store error: "
                "not dispatched, retried next tick"
            )
            fail_closed(self._runtime, "claim_write", what, claimed.error)
        elif claimed.error is not None:
            self._runtime.note_store_error()  # the reconciler's grace
        for new in claimed.failed:
            plans[entry_of(new)].failed.append(fire_of(new))
        for new, _ in claimed.won:
            guard.claimed(new.ref, fire_of(new), entry_of(new))
            plans[entry_of(new)].won.append(fire_of(new))
        for new, _ in [*claimed.won, *claimed.taken]:
            plans[entry_of(new)].claimed.append(fire_of(new))
        if claimed.refused:
            self._store_lost(claimed.refused, policies)
        if claimed.taken:
            self._conflicts.check(claimed.taken, now)
        return [job for _, job in claimed.won]

    def _store_lost(self, lost: list[NewJob], policies: Mapping[str, EntryPolicy]) -> None:
        """Claims refused for an epoch mismatch: skip them, count, and adopt the new epoch."""
        metrics.event(
            "store_loss_detected",
            f"the store lost its data (epoch changed): {len(lost)} slot(s) can no longer be "
            "proven unclaimed and are skipped",
            level=logging.ERROR,
            labels={"where": "epoch"},
            sentry=True,
        )
        for new in lost:
            self.skipped(entry_of(new), [fire_of(new)], "store_loss", policies, new.task)
        self._guard.epoch_refused(self._runtime.store, [entry_of(new) for new in lost])


def rotated(plans: list[Plan], node: str) -> list[Plan]:
    """``plans`` from a place of their own for ``node``: nodes that tick together claim apart.

    Every node claims every due slot; in the same order, they would all race
    for the same batch, each paying for the claims the fastest won. Each
    starts at the place its node id hashes to and goes round: a node meets
    the slots others claimed once it has claimed its own share, when a read
    answers them (``EXISTS``) without a write. An entry's slots keep their order.
    """
    if len(plans) < 2:
        return plans
    start = zlib.crc32(node.encode("utf-8")) % len(plans)
    return plans[start:] + plans[:start]


@dataclasses.dataclass(frozen=True)
class _Kept:
    """An entry's job of an earlier slot, and what it was built from (a deep copy)."""

    job: NewJob
    policy: EntryPolicy
    source: tuple[Any, ...]

    @classmethod
    def of(cls, entry: Any, policy: EntryPolicy, job: NewJob) -> _Kept:
        return cls(job, policy, copy.deepcopy(_source(entry)))

    def holds(self, entry: Any, policy: EntryPolicy) -> bool:
        """Whether a job built now would be built from the same entry and policy."""
        return policy == self.policy and _source(entry) == self.source


def _source(entry: Any) -> tuple[Any, ...]:
    """What an entry's job is built from (:func:`entries.occurrence`)."""
    return (entry.task, entry.args, entry.kwargs, entry.options)


def _internal(job: Job, policies: Mapping[str, EntryPolicy]) -> bool:
    policy = policies.get(job.entry or "")
    return policy is not None and policy.internal
