"""The reconciler: resolves jobs a crash or a lost message left between states.

docs/design/protocol.md, "The reconciler". One pass, under a token-checked lease
(``exactonce_lease_ttl``, renewed between batches, released at the end), looks
at the stale jobs of each live state, oldest first, and acts on each with a
compare-and-swap on the ``rev`` it listed, so a job that moved meanwhile (a
worker picked it up) is left alone. On a store of several partitions (the
shards of a sharded Redis Cluster namespace) it does so in each partition
whose lease it takes (:mod:`~celery_exactonce.reconcile.leased_passes`): the pages,
the cursors and the purge below are per partition, the budget of
redispatches per pass:

* ``SCHEDULED`` older than ``replay_age``: replayed through the dispatch path
  (safe even if an earlier publish landed: the gate admits one delivery).
  After :data:`MAX_REPLAYS` replays it is ``FAILED``; past its deadline,
  ``CANCELLED``.
* ``DISPATCHED``: a plain job (no gate) ends ``TIMEOUT`` (``unconfirmed``) after
  ``dispatch_timeout``, never republished. A gated job ends ``TIMEOUT`` after
  ``dispatch_deadline``; a task that opts in (``exactonce_redispatch = True``,
  asserting every consumer of its queue runs the gate) is redispatched with
  exponential backoff from ``dispatch_timeout``, at most
  :data:`REDISPATCH_BUDGET` per pass and :data:`MAX_REDISPATCHES` per job.
* ``RUNNING`` with no heartbeat for ``running_timeout``: ``TIMEOUT``; a task
  that opts in (``exactonce_rerun = True``: at-least-once) runs again as its
  next attempt.
* terminal jobs past the retention: purged.

Ages are measured on the store's clock (``list_stale`` and the ``stale_for``
guard of each write), so a reconciler whose clock is wrong times out nothing
early. For a grace period (``running_timeout``) after this process met a
store-wide error, in a pass, a beat tick or a heartbeat, a reconciler times
nothing out: heartbeats could not be written either.

Every bound (pages, batches, budget, tries per job) keeps a pass finite
whatever the store does. A pass reads at most :data:`LIST_PAGES` pages of
:data:`LIST_LIMIT` stale jobs per state, going on from where this
reconciler's previous pass stopped (a keyset cursor on ``(touched_at, ref)``)
and back to the oldest once a page comes back short. So each stale job is
looked at once per sweep of its state, a sweep takes
``stale // (LIST_PAGES * LIST_LIMIT) + 1`` passes whatever sits at the head,
and neither a backlog that stays stale without being acted on (gated jobs waiting
in a busy queue for their ``dispatch_deadline``) nor failing jobs can starve
the jobs behind them. A job whose action failed also waits (exponential
backoff) before this reconciler tries it again.

Per task, as attributes: ``exactonce_dispatch_timeout``,
``exactonce_dispatch_deadline``, ``exactonce_running_timeout``,
``exactonce_redispatch``, ``exactonce_rerun``.

Not here: the pass over the partitions and their leases
(:mod:`~celery_exactonce.reconcile.leased_passes`, the base of :class:`Reconciler`);
what a pass reports and logs, and what its handlers share
(:mod:`~celery_exactonce.reconcile.passes`); a task's limits (:mod:`~celery_exactonce.policy`);
running passes on beat or as a task (:mod:`~celery_exactonce.reconcile.task`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from celery_exactonce.core import exceptions, jobs
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import Action, Transition
from celery_exactonce.dispatch.messages import GATED_OPTION
from celery_exactonce.dispatch.outcomes import Outcome
from celery_exactonce.observe import metrics
from celery_exactonce.policy import Timeouts, youngest_ages
from celery_exactonce.reconcile.leased_passes import LEASE_NAME as LEASE_NAME  # noqa: PLC0414  (its home)
from celery_exactonce.reconcile.leased_passes import LeasedPasses
from celery_exactonce.reconcile.passes import Pass, count_actions
from celery_exactonce.reconcile.passes import PassReport as PassReport  # noqa: PLC0414  (run_pass's)
from celery_exactonce.runtime import Runtime
from celery_exactonce.stores import settle

#: Stale jobs listed per page, pages per state, partition and pass; and the batch between
#: lease renewals.
LIST_LIMIT = 1000
LIST_PAGES = 3
BATCH = 100
#: Dispatches after which a ``SCHEDULED`` job that never ran is ``FAILED``.
MAX_REPLAYS = 5

#: History reasons of the reconciler's replays, redispatches and re-runs (for people;
#: the caps count the entries' :class:`~celery_exactonce.core.writes.Action`).
REPLAY_REASON = "reconciler replay"
REDISPATCH_REASON = "reconciler redispatch"
RERUN_REASON = "reconciler rerun"
#: Re-runs of one opted-in job whose worker vanished; then it times out.
MAX_RERUNS = 3
#: Redispatches of one opted-in ``DISPATCHED`` job, and of all jobs in one pass.
MAX_REDISPATCHES = 10
REDISPATCH_BUDGET = 100
#: Purged terminal records per partition and pass.
PURGE_LIMIT = 1000
#: How long (seconds) a job whose action failed waits before this reconciler retries it.
RETRY_BACKOFF = 5.0
RETRY_BACKOFF_MAX = 300.0


#: What acts on one stale job of a state, in a pass.
Handler = Callable[[Pass, Job], None]


class Reconciler(LeasedPasses):
    """Runs reconcile passes for one app's namespace (see the module docs)."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        tasks: Mapping[str, Any] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """``tasks``: where per-task limits are read (default: the runtime's app's registry)."""
        super().__init__(runtime, monotonic)
        self._tasks = tasks if tasks is not None else getattr(runtime.app, "tasks", {})
        self._retry_at: dict[JobRef, tuple[float, int]] = {}
        # Per partition and state, the (touched_at, ref) the previous pass stopped after;
        # absent: the oldest.
        self._cursors: dict[tuple[int, State], tuple[datetime, JobRef]] = {}

    # -- one partition ----------------------------------------------------------------

    def _pass(self, run: Pass) -> None:
        """The stale jobs of ``run.part``, state by state, then its expired records."""
        dispatch_age, running_age = self._ages()
        self._each(run, State.SCHEDULED, self.runtime.config.replay_age, self._scheduled)
        self._each(run, State.DISPATCHED, dispatch_age, self._dispatched)
        if run.timeouts_ok:
            self._each(run, State.RUNNING, running_age, self._running)
        try:
            run.report.expired += run.part.purge_expired(PURGE_LIMIT)
        except exceptions.StoreError as exc:
            self._store_error(run.report, exc, "purge")

    def _each(self, run: Pass, state: State, older_than: float, act: Handler) -> None:
        """Act on up to :data:`LIST_PAGES` pages of stale ``state`` jobs, from its cursor.

        The listing is in ``(touched_at, ref)`` order, not by what is due: jobs
        listed but not acted on stay at the head. Paging on from the cursor
        across passes (back to the oldest after a short page) reaches the jobs
        behind them anyway. The cursor moves only past a page acted on to its
        end, so a pass cut short (a lost lease, a bug) skips nothing.
        """
        store, report, at = run.part, run.report, (run.index, state)
        for _ in range(LIST_PAGES):
            self._renew(run)
            try:
                stale = store.list_stale(state, older_than, LIST_LIMIT, after=self._cursors.get(at))
                run.now = store.now()  # ages below err young: nothing is acted on early
            except exceptions.StoreError as exc:
                self._store_error(report, exc, f"list {state}")
                return
            report.stale[state.value] = report.stale.get(state.value, 0) + len(stale)
            self._act_on(run, stale, act)
            if len(stale) < LIST_LIMIT:
                self._cursors.pop(at, None)  # the end: the next pass starts from the oldest
                return
            self._cursors[at] = (stale[-1].touched_at, stale[-1].ref)

    def _act_on(self, run: Pass, stale: list[Job], act: Handler) -> None:
        """``act(run, job)`` on each listed job not backing off."""
        now = self._monotonic()
        for i, job in enumerate(stale):
            if i and i % BATCH == 0:
                self._renew(run)
            retry = self._retry_at.get(job.ref)
            if retry is not None and retry[0] > now:
                run.report.skipped += 1
                continue
            try:
                act(run, job)
            except exceptions.StoreError as exc:
                # One job's failure is no outage: it backs off, the grace stays as it is.
                self._store_error(run.report, exc, f"act on {job.ref}", outage=False)
                self._back_off(job.ref)
            else:
                self._retry_at.pop(job.ref, None)

    # -- per state -----------------------------------------------------------------------

    def _scheduled(self, run: Pass, job: Job) -> None:
        """Replay a ``SCHEDULED`` job that nobody dispatched (crash between claim and publish)."""
        report = run.report
        if job.deadline is not None and run.now >= job.deadline:
            if self._move(run, job, State.CANCELLED, "deadline passed before replay"):
                report.cancelled += 1
            return
        replays = count_actions(job, Action.REPLAY)
        if replays >= MAX_REPLAYS:
            reason = f"replayed {replays} times without running"
            if self._move(run, job, State.FAILED, reason):
                report.failed += 1
                metrics.event(
                    "replay_gave_up",
                    f"job {job.ref}: {reason}: FAILED",
                    level=logging.ERROR,
                    sentry=True,
                    job_id=job.ref.id,
                    task=job.task,
                    key=job.entry,
                    state=State.SCHEDULED.value,
                )
            return
        result = self.runtime.dispatcher.dispatch(
            job, reason=REPLAY_REASON, retry=False, lease=run.lease, action=Action.REPLAY
        )
        if isinstance(result.error, exceptions.LeaseLost):
            raise result.error
        if result.outcome is Outcome.FAIL_CLOSED:
            raise exceptions.StoreUnavailable(f"replay of {job.ref} failed closed")
        if result.outcome in (Outcome.PUBLISHED, Outcome.AMBIGUOUS):
            report.replayed += 1
            metrics.event(
                "replayed",
                f"job {job.ref} replayed ({result.outcome.value})",
                job_id=job.ref.id,
                task=job.task,
            )
        elif result.outcome is Outcome.FAILED:
            report.failed += 1
        elif result.outcome is Outcome.EXPIRED:
            report.cancelled += 1

    def _dispatched(self, run: Pass, job: Job) -> None:
        limits = self._timeouts(job)
        age = (run.now - job.touched_at).total_seconds()
        if not job.options.get(GATED_OPTION):
            if run.timeouts_ok and age >= limits.dispatch_timeout:
                self._time_out(run, job, "unconfirmed", limits.dispatch_timeout)
            return
        redispatches = count_actions(job, Action.REDISPATCH)
        # An atomic job's runs that did not commit left nothing behind: it is redispatched
        # past dispatch_deadline too, until its redispatches run out.
        trying = limits.atomic and redispatches < MAX_REDISPATCHES
        if run.timeouts_ok and age >= limits.dispatch_deadline and not trying:
            reason = f"not run within dispatch_deadline ({limits.dispatch_deadline:g} s)"
            self._time_out(run, job, reason, limits.dispatch_deadline)
            return
        if not limits.redispatch or run.report.redispatched >= REDISPATCH_BUDGET:
            return
        backoff = limits.dispatch_timeout * 2 ** min(redispatches, 16)
        if redispatches >= MAX_REDISPATCHES or age < backoff:
            return
        request = Transition(
            State.DISPATCHED,
            frozenset({State.DISPATCHED}),
            node=self.runtime.node,
            reason=f"{REDISPATCH_REASON} {redispatches + 1}",
            rev=job.rev,
            lease=run.lease,
            stale_for=backoff,
            action=Action.REDISPATCH,
        )
        if self._publish_after(job, request):
            run.report.redispatched += 1

    def _running(self, run: Pass, job: Job) -> None:
        limits = self._timeouts(job)
        if (run.now - job.touched_at).total_seconds() < limits.running_timeout:
            return
        reruns = count_actions(job, Action.RERUN)
        if limits.rerun and job.options.get(GATED_OPTION) and reruns < MAX_RERUNS:
            request = Transition(
                State.DISPATCHED,
                frozenset({State.RUNNING}),
                node=self.runtime.node,
                reason=f"{RERUN_REASON} {reruns + 1}: no heartbeat",
                rev=job.rev,
                lease=run.lease,
                stale_for=limits.running_timeout,
                next_attempt=True,
                action=Action.RERUN,
            )
            if self._publish_after(job, request):
                run.report.rerun += 1
            return
        reason = f"no heartbeat for {limits.running_timeout:g} s"
        self._time_out(run, job, reason, limits.running_timeout)

    # -- writes ------------------------------------------------------------------------

    def _publish_after(self, job: Job, request: Transition) -> bool:
        """CAS ``request`` (to ``DISPATCHED``), then publish what it returned."""
        result = self._write(job.ref, request)
        if result is None:
            return False
        self.runtime.dispatcher.publish(result)
        return True

    def _time_out(self, run: Pass, job: Job, reason: str, stale_for: float) -> None:
        if self._move(run, job, State.TIMEOUT, reason, stale_for=stale_for):
            run.report.timed_out += 1
            metrics.event(
                "timed_out",
                f"job {job.ref} ({job.task}) {job.state} → TIMEOUT: {reason}",
                level=logging.WARNING,
                labels={"state": job.state.value},
                sentry=True,
                job_id=job.ref.id,
                task=job.task,
                key=job.entry,
            )

    def _move(
        self, run: Pass, job: Job, state: State, reason: str, *, stale_for: float | None = None
    ) -> bool:
        """CAS ``job`` from the state and rev it was listed with to ``state``; whether it did."""
        request = Transition(
            state,
            frozenset({job.state}),
            node=self.runtime.node,
            reason=reason,
            rev=job.rev,
            lease=run.lease,
            stale_for=stale_for,
        )
        return self._write(job.ref, request) is not None

    def _write(self, ref: JobRef, request: Transition) -> Job | None:
        """The CAS; the new record if it applied. A lost lease stops the pass."""
        result = settle.transition(self.runtime.store, ref, request)
        if result.error is not None and not result.applied:
            raise result.error
        if result.status is jobs.TransitionStatus.LEASE_LOST:
            raise exceptions.LeaseLost(f"lease lost before writing {ref}")
        return result.job if result.applied else None

    # -- helpers -----------------------------------------------------------------------

    def _ages(self) -> tuple[float, float]:
        """The youngest ``DISPATCHED`` and ``RUNNING`` ages any task's limits act on."""
        return youngest_ages(self.runtime.config, list(self._tasks.values()))

    def _timeouts(self, job: Job) -> Timeouts:
        return Timeouts.of(self.runtime.config, self._tasks.get(job.task), job)

    def _back_off(self, ref: JobRef) -> None:
        _, tries = self._retry_at.get(ref, (0.0, 0))
        delay = min(RETRY_BACKOFF * 2**tries, RETRY_BACKOFF_MAX)
        self._retry_at[ref] = (self._monotonic() + delay, tries + 1)
        if len(self._retry_at) > 10 * LIST_LIMIT:  # bounded memory: forget the oldest
            for stale in list(self._retry_at)[:LIST_LIMIT]:
                del self._retry_at[stale]
