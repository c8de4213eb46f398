"""ExactOnceScheduler: leaderless beat; every node ticks, the store decides who dispatches.

Load it with ``beat_scheduler = "exactonce"`` (or ``celery beat -S exactonce``).
It reads the ordinary ``beat_schedule``, and the entries stored at run time
(:mod:`~celery_exactonce.beat.stored`). Every node derives the same nominal
slots (:mod:`celery_exactonce.core.slots`), claims each due one with a
create-if-absent that also checks the store epoch and advances the entry's
durable watermark, and dispatches the claims it won through the dispatch path
(docs/design/protocol.md, "Beat").

This module is the Celery adapter: what goes into the heap of entries keyed by
next slot (:mod:`~celery_exactonce.beat.due_heap`: the cost of a tick follows the
due and the edited entries, not all of them), how far this node has decided
each entry, the tick, the sweep of delayed jobs, and SIGTERM. What
it decides with lives elsewhere, as values, in modules that never call back
into it:

* :mod:`~celery_exactonce.beat.entries`: each entry's policy and checks (a bad
  entry is refused at start-up, naming it), and the job of a slot;
* :mod:`~celery_exactonce.beat.planner`: which due slots to claim and which to
  skip, and why (every skipped slot is counted);
* :mod:`~celery_exactonce.beat.claimer`: the planned slots claimed in batches
  (:meth:`StateStore.create_many`), the won ones dispatched in batches
  (:meth:`Dispatcher.dispatch_many`), and what each answer means for the node;
* :mod:`~celery_exactonce.beat.store_loss`: the epoch, the floor and the re-check
  of recent claims that keep a store that lost data from being claimed twice;
* :mod:`~celery_exactonce.beat.conflicts`: slots found claimed by another app's
  entry of the same name;
* :mod:`~celery_exactonce.beat.sweeper`: the sweep of the due delayed jobs.

A node that has not decided an entry's slots lately (it started, or fell behind)
starts from the entry's store watermark: what is at or below it was decided by
whoever claimed it, and is neither planned nor counted again. A claim that
fails on a store error leaves its slot undecided: the next tick inside the window tries
again (fail closed). Entries added at run time (stored ones, or through Celery's
``Scheduler.add`` or ``update_from_dict``) join the heap on the next tick.

After the slots, each tick sweeps the due delayed jobs (``ExactOnceTask``
submissions and retries with an ``eta`` or ``countdown``): claimed in
``run_at`` order and in bounded batches, then dispatched.

SIGTERM during a tick is held until the tick ends: its claims are dispatched,
then beat exits. What a SIGKILL cuts short (claims not yet published) is the
reconciler's to resolve: beat runs it too, as an internal entry
(``celery_exactonce.reconcile``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

from celery import beat

from celery_exactonce import startup
from celery_exactonce.beat import entries, planner, sweeper
from celery_exactonce.beat import log as beat_log
from celery_exactonce.beat.claimer import Claimer, fail_closed
from celery_exactonce.beat.due_heap import DueHeap
from celery_exactonce.beat.entries import ENTRY_OPTIONS, INTERNAL_OPTION, EntryPolicy
from celery_exactonce.beat.holds import HeldSigterm, collector_held
from celery_exactonce.beat.planner import Plan
from celery_exactonce.beat.skips import SkipTally
from celery_exactonce.beat.store_loss import StoreLossGuard
from celery_exactonce.beat.stored import StoredEntries
from celery_exactonce.config import ExactOnceConfig
from celery_exactonce.core import exceptions, slots
from celery_exactonce.observe import metrics
from celery_exactonce.observe.gauges import BeatGauges
from celery_exactonce.policy import task_policy
from celery_exactonce.reconcile import task as reconcile_task
from celery_exactonce.reconcile.task import RECONCILE_TASK, BeatRunner
from celery_exactonce.runtime import Runtime
from celery_exactonce.task.base import ExactOnceTask


def entry_policy(
    app: Any, config: ExactOnceConfig, name: str, entry: Any, *, internal: bool = False
) -> EntryPolicy:
    """The policy of beat entry ``entry``, with what this process registers of its task."""
    task = app.tasks.get(entry.task)
    gated = None if task is None else isinstance(task, ExactOnceTask)
    return EntryPolicy.of(
        name,
        entry,
        config,
        task_gated=gated,
        task_policy=task_policy(task) if gated else None,
        internal_allowed=internal,
    )


def internal_entries(config: ExactOnceConfig) -> dict[str, Any]:
    """Beat's own entries: the reconciler's, one pass per ``reconcile_interval`` across nodes."""
    return {
        RECONCILE_TASK: {
            "task": RECONCILE_TASK,
            "schedule": timedelta(seconds=config.reconcile_interval),
            "options": {ENTRY_OPTIONS: {"catchup": "latest"}, INTERNAL_OPTION: True},
        }
    }


class ExactOnceScheduler(beat.Scheduler):  # type: ignore[misc]  # celery is untyped
    """A ``celery.beat.Scheduler`` that dispatches each occurrence once across all nodes."""

    #: Run reconcile passes (``exactonce_reconcile_on = "beat"``) in a thread of
    #: their own; ``False`` runs them inside the tick (deterministic tests).
    reconcile_in_thread = True

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        # The start-up checks: a refused setting ends beat here, naming it, before any tick.
        self._runtime: Runtime = startup.start_beat(app)
        self._config = self._runtime.config
        self._tz = ZoneInfo(str(app.timezone))
        self._decided: dict[str, datetime] = {}
        config = self._config
        self._guard = StoreLossGuard(
            max_skew=config.max_skew, window_lookback=config.window_lookback, shards=config.shards
        )
        self._skips = SkipTally()
        self._policies: dict[str, EntryPolicy] = {}
        self._claimer = Claimer(
            self._runtime,
            self._guard,
            self._skips,
            BeatRunner(self._runtime, threaded=self.reconcile_in_thread)
            if self._config.reconcile_on == "beat"
            else None,
        )
        self._due = DueHeap()
        self._heap_ready = False  # False: every entry's next slot is computed again next tick
        self._stale: set[str] = set()  # entries changed at run time: pushed again next tick
        self._sigterm = HeldSigterm()
        self._started = False
        self._stored: StoredEntries | None = None  # made with the schedule
        try:
            super().__init__(app, *args, **kwargs)  # setup_schedule checks every entry
        except exceptions.ConfigurationError as exc:  # a bad entry: refused as a bad setting is
            startup.refuse("beat", exc)
        self._sigterm.install()
        self._gauges = BeatGauges(self._runtime.node, store_errors=self._store_error_at)
        # Not for the lazy instance `celery beat` builds only to print its banner.
        lazy = kwargs.get("lazy", False)
        self._metrics = (
            None
            if lazy
            else startup.serve_beat_metrics(
                self._runtime, self._gauges, lambda: dict(self.schedule), self._tz
            )
        )

    # -- celery.beat.Scheduler interface ---------------------------------------------

    def setup_schedule(self) -> None:
        """``beat_schedule`` and the stored entries; a name in both refuses beat, naming it."""
        self._setup_entries(self.app.conf.beat_schedule)
        self._stored = StoredEntries(self._runtime.store, frozenset(self.schedule))
        self._stored.start(self)

    def _setup_entries(self, schedule: Mapping[str, Any]) -> None:
        """Start from ``schedule`` and beat's own entries, each checked (a bad one raises)."""
        reconcile_task.register_task(self.app)
        internal = self._internal_entries()
        merged = entries.readable({**schedule, **internal}, self._maybe_entry)
        self.merge_inplace(merged)
        now = self._runtime.store.now()
        for name, entry in self.schedule.items():
            self._validate(name, entry, now, internal=name in internal)
        self._due.clear()
        self._heap_ready = False

    def _validate(self, name: str, entry: Any, now: datetime, *, internal: bool = False) -> None:
        """Check ``entry`` as beat will use it (:func:`entries.check_entry`); keep its policy."""
        with entries.reading(name):  # whatever Celery raises, a refusal naming the entry
            self._policies[name] = entries.check_entry(
                name,
                entry,
                lambda name, entry: self._policy_of(name, entry, internal=internal),
                tz=self._tz,
                now=now,
                namespace=self._runtime.store.namespace,
                node=self._runtime.node,
            )

    def _policy_of(self, name: str, entry: Any, *, internal: bool = False) -> EntryPolicy:
        return entry_policy(self.app, self._config, name, entry, internal=internal)

    def _internal_entries(self) -> dict[str, Any]:
        return internal_entries(self._config)

    def add(self, **kwargs: Any) -> Any:
        """Celery's ``Scheduler.add``: the new entry joins the due heap.

        A bad entry raises :class:`ConfigurationError` naming it; the schedule
        keeps the entry it had under that name, if any.
        """
        previous = dict(self.schedule)
        entry = super().add(**kwargs)
        self._changed([entry.name], previous)
        return entry

    def update_from_dict(self, dict_: dict[str, Any]) -> None:
        """Celery's ``Scheduler.update_from_dict``: changed entries join the due heap.

        If any of them is bad, :class:`ConfigurationError` names it and the
        schedule is left as it was.
        """
        previous = dict(self.schedule)
        super().update_from_dict(dict_)
        self._changed(list(dict_), previous)

    def _forget(self, name: str) -> None:
        """An entry taken out of ``self.schedule``: drop its policy and its place in the heap."""
        self._policies.pop(name, None)
        self._due.discard(name)
        self._stale.discard(name)

    def drop_entry(self, name: str) -> None:
        """Take entry ``name`` out of the schedule (a stored one removed or paused)."""
        if self.schedule.pop(name, None) is not None:
            self._forget(name)
        self._decided.pop(name, None)  # its watermark guards it, if it comes back

    def _tick_started(self, now: datetime) -> None:
        """A tick read the store's clock (``now``) and will plan next; the schedule may change.

        The stored entries are read again if they changed (a scheduler that keeps
        its entries elsewhere, the django-celery-beat one, reads those instead).
        """
        if self._stored is not None:
            self._stored.tick(self, now)

    def _claimed(self, plans: list[Plan]) -> None:
        """After a tick's claims and their dispatch; each plan's :attr:`Plan.claimed` slots.

        Nothing to do here: a scheduler that keeps its entries elsewhere (the
        django-celery-beat one) records their runs.
        """

    def _changed(self, names: list[str], previous: dict[str, Any]) -> None:
        """Entries added or replaced at run time: validate them, push them again next tick.

        A bad one puts ``previous`` back (entries and their policies) and raises.
        """
        now = datetime.now(timezone.utc)
        policies = dict(self._policies)
        try:
            for name in names:
                self._validate(name, self.schedule[name], now)
        except exceptions.ConfigurationError:
            self.schedule.clear()
            self.schedule.update(previous)
            self._policies = policies
            raise
        self._stale.update(names)

    def _store_error_at(self) -> float | None:
        return self._runtime.store_error_at

    @property
    def info(self) -> str:
        return beat_log.banner(self._config, self._runtime.node)

    def tick(self, *_args: Any, **_kwargs: Any) -> float:
        """One pass over the due entries; returns the seconds to sleep.

        A SIGTERM that arrives during the pass is held until the pass ends, so
        every claim made in it is dispatched (never left half-done by an
        exception raised mid-claim); then beat stops. The cyclic garbage
        collector waits for the pass too (:func:`~celery_exactonce.beat.holds.collector_held`).
        """
        with self._gauges.ticking(), self._sigterm.ticking(), collector_held():
            return self._tick()

    def _tick(self) -> float:
        interval = float(self._config.tick_interval)
        store = self._runtime.store
        try:
            now = store.now()
            if self._guard.epoch is None:
                self._guard.adopt(store.epoch())
                if not self._started:  # the first tick that reached the store
                    self._started = True
                    beat_log.started(self._config, self._runtime.node, self._guard, now)
            forgotten = self._guard.recheck(store, now)
            self._gauges.reached()
        except exceptions.StoreError as exc:
            self._gauges.reached(exc)
            what = "beat cannot reach the store: nothing claimed"
            fail_closed(self._runtime, "tick_read", what, exc)
            return interval
        if forgotten is not None:
            metrics.event(
                "store_loss_detected",
                forgotten.message(),
                level=logging.ERROR,
                labels={"where": "recheck"},
                sentry=True,
            )
        self._tick_started(now)
        self._queue_changes(now)
        due = [(name, slot) for name, slot in self._due.pop_due(now) if name in self.schedule]
        popped = [(name, self.schedule[name]) for name, _ in due]
        try:
            self._load_watermarks(due, now)
        except exceptions.StoreError as exc:
            for name, entry in popped:
                self._push(name, entry, now)
            what = "beat cannot read the watermarks: nothing claimed"
            fail_closed(self._runtime, "tick_read", what, exc)
            return interval
        plans = [plan for name, entry in popped if (plan := self._plan(name, entry, now)).due]
        self._claimer.claim_and_dispatch(plans, now, self._policies)
        for plan in plans:  # what failed on a store error stays undecided (fail closed)
            self._decided[plan.name] = plan.decided_to()
        self._claimed(plans)
        self._skips.flush(self._runtime.store, self._runtime.node)
        for name, entry in popped:
            self._push(name, entry, now)
        if sweeper.sweep(self._runtime, lambda: self._sigterm.requested):
            return 0.0  # more delayed jobs are due: tick again at once
        upcoming = self._due.next_time()
        if upcoming is not None:
            return max(0.0, min(interval, (upcoming - now).total_seconds()))
        return interval

    def sync(self) -> None:
        """Nothing to persist locally: the store holds every claim and watermark."""

    def close(self) -> None:
        """Celery's ``Scheduler.close``; stops the ``/metrics`` endpoint too."""
        if self._metrics is not None:
            self._metrics.close()
        super().close()

    # -- internals -----------------------------------------------------------------------

    def _queue_changes(self, now: datetime) -> None:
        """Every entry into the heap at the first tick (O(entries), once); after that, only
        the entries changed at run time (O(changed)), each at its next slot again."""
        if not self._heap_ready:
            self._due.clear()
            for name, entry in self.schedule.items():
                self._push(name, entry, now)
            self._heap_ready = True
        else:
            for name in sorted(self._stale):
                entry = self.schedule.get(name)
                if entry is None:
                    self._due.discard(name)
                else:
                    self._push(name, entry, now)
        self._stale.clear()

    def _push(self, name: str, entry: Any, now: datetime) -> None:
        after = self._decided.get(name, now - timedelta(seconds=self._config.window_lookback))
        upcoming = slots.next_slot(entry.schedule, after, tz=self._tz, entry=name)
        if upcoming is None:
            self._due.discard(name)  # no slot left (a bounded schedule ended)
        else:
            self._due.push(name, upcoming)

    def _policy(self, name: str, entry: Any) -> EntryPolicy:
        policy = self._policies.get(name)
        if policy is None:
            policy = self._policies[name] = self._policy_of(name, entry)
        return policy

    def _load_watermarks(self, due: list[tuple[str, datetime]], now: datetime) -> None:
        """Start entries this node is behind on from their store watermark.

        ``due`` are the popped entries with the slot each was queued at: the
        first after the slot this node decided last. On time for it (within
        two ticks), the node missed none of the entry's slots, and the claim
        answers whether another node took this one. Otherwise (a restarted
        node, or one that fell behind) slots at or below the watermark are
        decided (claimed, or skipped by whoever claimed a newer one): the node
        neither re-plans nor counts them.
        """
        behind = now - timedelta(seconds=2 * self._config.tick_interval)
        stale = [n for n, slot in due if n not in self._decided or slot < behind]
        if not stale:
            return
        for name, mark in self._runtime.store.watermarks(stale).items():
            if mark > self._decided.get(name, mark - timedelta(seconds=1)):
                self._decided[name] = mark

    def _plan(self, name: str, entry: Any, now: datetime) -> Plan:
        """The entry's plan (:func:`planner.plan`): its skipped slots noted, its claims built."""
        policy = self._policy(name, entry)
        decided = self._decided.get(name)
        plan = planner.plan(
            name,
            entry.schedule,
            policy,
            tz=self._tz,
            config=self._config,
            decided=decided,
            now=now,
            floor=self._guard.floor_for(name),
            floor_reason=self._guard.reason_for(name),
            born=self._guard.born_for(name),
        )
        if decided is not None:
            self._decided[name] = plan.start
        for where, fires in plan.skipped:
            self._claimer.skipped(name, fires, where, self._policies, entry.task)
        plan.claims = [self._claimer.occurrence(name, entry, policy, fire) for fire in plan.claim]
        return plan
