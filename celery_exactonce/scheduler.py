"""ExactOnceScheduler: leaderless beat; every node ticks, the store decides who dispatches.

Load it with ``beat_scheduler = "exactonce"`` (or ``celery beat -S exactonce``).
It reads the ordinary ``beat_schedule``. Every node derives the same nominal
slots (:mod:`celery_exactonce.slots`), claims each due one with a
create-if-absent that also checks the store epoch and advances the entry's
durable watermark, and dispatches the claims it won through the dispatch path
(docs/design/protocol.md, "Beat").

Per tick, for each entry whose next slot is due (a heap keyed by next slot:
the cost follows the due entries, not all of them):

* slots in ``(last settled, store time]`` and within ``window_lookback`` are
  due. Due-ness is judged on the store's clock, never this node's, so a node
  never claims a slot before ``store time >= fire_time`` (judging on store
  time needs no ``max_skew`` allowance for early nodes);
* a node that has not settled an entry lately (it started, or fell behind)
  starts from the entry's store watermark: what is at or below it was decided
  by whoever claimed it, and is neither planned nor counted again;
* after downtime, the entry's catch-up policy picks which missed slots to
  claim (``latest`` by default, the newest ``catchup_limit`` with ``all``,
  ``none``); ``max_lateness`` skips slots that are too late; every skipped
  slot is counted (``where=catchup``). Slots that left the window unclaimed
  while this node held the entry are counted too (``where=window``);
* a claim that fails on a store error is not settled: the next tick inside
  the window tries again (fail closed);
* the claims of a tick go to the store in batches (:meth:`StateStore.create_many`)
  and the won ones are dispatched in batches (:meth:`Dispatcher.dispatch_many`).

Store loss (a Redis restart without persistence, a failover to a lagging
replica): a slot whose claim the store may have forgotten can no longer be
proven unclaimed, so it is skipped and counted, never claimed again:

* every claim carries the epoch this node holds; a mismatch means the store
  lost its data, and the node adopts the store's new epoch;
* epochs carry their birth time on the store clock. No slot at or before
  ``birth + max_skew`` is ever claimed: a claim from before the loss had
  ``store time >= fire_time``, so only those slots can have been claimed in the
  life the store forgot. (A brand-new namespace therefore starts claiming
  ``max_skew`` seconds after its first tick.)
* each node re-reads a few of its own recent claims every tick; one that is
  gone while it should still be kept shows a loss the epoch did not (a lagging
  replica keeps an old epoch), and the node moves its floor to
  ``store time + max_skew`` and replaces the epoch, so the other nodes' next
  claims are refused and their floors move too. What this leaves open (a
  store that forgot only its last writes, for about one tick) is in
  docs/design/protocol.md, "Store loss".

Every entry is checked when beat starts (and when one is added at run time):
its name, task name, arguments and options must make a job the store can
hold and ``send_task`` can publish. A bad entry is refused with a
:class:`~celery_exactonce.exceptions.ConfigurationError` naming it, so beat
does not start with it (rather than dying at its first due slot on every
node). Arguments kombu's JSON serializer carries (``datetime``, ``Decimal``,
``UUID``, ``bytes``...) are stored in kombu's encoding and published as
plain Celery publishes them.

Two apps on one namespace that define one entry name differently (another
task, other arguments) compete for the same slots, and only the winner's
job runs: a node that finds a slot claimed by a record that is not its
entry's logs a ``claim_conflict`` warning (at most once per entry every
:data:`CONFLICT_RECHECK` seconds).

Per-entry overrides live under ``options["exactonce"]`` (:class:`EntryPolicy`):
``{"catchup": "all", "max_lateness": 600, "deadline": 300}``. Entries added at
run time through Celery's ``Scheduler.add`` or ``update_from_dict`` join the
heap on the next tick.

After the slots, each tick sweeps the due delayed jobs (``ExactOnceTask``
submissions and retries with an ``eta`` or ``countdown``): claimed in
``run_at`` order and in bounded batches, then dispatched.

SIGTERM during a tick is held until the tick ends: its claims are dispatched,
then beat exits. What a SIGKILL cuts short (claims not yet published) is the
reconciler's to settle: beat runs it too, as the internal entry
``celery_exactonce.reconcile``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import heapq
import logging
import signal
import threading
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

from celery import beat

from celery_exactonce import config as config_module
from celery_exactonce import exceptions, jobs, keys, metrics, reconcile_task, slots, startup
from celery_exactonce.jobs import CreateStatus, JobRef, NewJob
from celery_exactonce.messages import GATED_OPTION, POLICY_OPTION, check_options
from celery_exactonce.reconcile_task import RECONCILE_TASK, BeatRunner
from celery_exactonce.runtime import Runtime
from celery_exactonce.states import State
from celery_exactonce.stores import redact_url, settle
from celery_exactonce.task import TASK_FLAGS, TASK_TIMEOUTS, ExactOnceTask, task_policy

logger = logging.getLogger(__name__)

#: Entry option key holding per-entry overrides.
ENTRY_OPTIONS = "exactonce"

#: Claims per ``create_many`` round trip.
CLAIM_BATCH = 500
#: Delayed jobs claimed per ``claim_due`` call, and at most this many calls per tick.
SWEEP_BATCH = 500
SWEEP_MAX_BATCHES = 20
#: This node's recent claims kept for the store-loss re-check, and how many each tick re-reads.
RECENT_CLAIMS = 1024
RECHECK_PER_TICK = 8
#: Seconds (store time) before an entry whose slot was found claimed is compared
#: again with the record that holds it, and how many records a tick reads for that.
CONFLICT_RECHECK = 600.0
CONFLICT_CHECKS_PER_TICK = 8


def occurrence_id(namespace: str, entry: str, fire_time: datetime) -> str:
    """The job id (Celery ``task_id``) of an occurrence: its idempotency key."""
    return keys.idempotency_key(entry, fire_time, namespace)


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
        self._epoch: str | None = None
        self._settled: dict[str, datetime] = {}
        self._floor: datetime | None = None  # no slot at or before it is ever claimed
        # Why slots at or below the floor are skipped: "unprovable" (the store's first
        # moments as this node met it: new, or wiped before), "store_loss" once detected.
        self._floor_reason = "unprovable"
        self._skips: dict[str, list[tuple[str, datetime, datetime, int]]] = {}
        self._policies: dict[str, EntryPolicy] = {}
        self._reconcile_runner = (
            BeatRunner(self._runtime, threaded=self.reconcile_in_thread)
            if self._config.reconcile_on == "beat"
            else None
        )
        self._recent: collections.deque[tuple[JobRef, datetime]] = collections.deque(
            maxlen=RECENT_CLAIMS
        )
        self._due: list[tuple[datetime, str]] = []
        self._conflict_checked: dict[str, datetime] = {}
        self._heap_ready = False
        self._in_tick = False
        self._stop_requested = False
        try:
            super().__init__(app, *args, **kwargs)  # setup_schedule checks every entry
        except exceptions.ConfigurationError as exc:  # a bad entry: refused as a bad setting is
            startup.refuse("beat", exc)
        self._install_sigterm()

    # -- celery.beat.Scheduler interface ---------------------------------------------

    def setup_schedule(self) -> None:
        reconcile_task.register_task(self.app)
        self.merge_inplace({**self.app.conf.beat_schedule, **self._internal_entries()})
        now = self._runtime.store.now()
        for name, entry in self.schedule.items():
            self._validate(name, entry, now)
        self._due = []
        self._heap_ready = False

    def _validate(self, name: str, entry: Any, now: datetime) -> None:
        """Check ``entry`` as beat will use it; :class:`ConfigurationError` naming it.

        Its schedule, its ``exactonce`` policy, its options (none that the
        dispatch path sets itself, ``headers`` a dict), and the job of a slot:
        name, task name and payload storable (what kombu's JSON carries).
        """
        label = f"beat entry {_label(name)}"
        if not isinstance(name, str):
            raise exceptions.ConfigurationError(f"{label}: the name must be a string",
                                                setting="beat_schedule")  # fmt: skip
        slots.validate_schedule(name, entry.schedule, self._tz, at=now)
        self._policies[name] = EntryPolicy.of(
            name, entry, self._config, self.app.tasks.get(entry.task)
        )
        options = {k: v for k, v in (entry.options or {}).items() if k != ENTRY_OPTIONS}
        try:
            check_options(options, context=label)
            self._occurrence(name, entry, now)
        except exceptions.InvalidPayload as exc:
            text = str(exc)
            if text.startswith(f"{jobs.Space.OCCURRENCE}:"):  # the probe job's id: noise here
                text = text.partition(": ")[2]
            message = text if text.startswith(label) else f"{label}: {text}"
            raise exceptions.ConfigurationError(message, setting="beat_schedule") from exc

    def _internal_entries(self) -> dict[str, Any]:
        """The reconciler's entry: one pass per ``reconcile_interval`` across all nodes."""
        return {
            RECONCILE_TASK: {
                "task": RECONCILE_TASK,
                "schedule": timedelta(seconds=self._config.reconcile_interval),
                "options": {ENTRY_OPTIONS: {"catchup": "latest"}},
            }
        }

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

    def _changed(self, names: list[str], previous: dict[str, Any]) -> None:
        """Entries added or replaced at run time: validate them, rebuild the heap next tick.

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
        self._heap_ready = False

    @property
    def info(self) -> str:
        return (
            f"    . store -> {redact_url(self._config.store_url)}"
            f" (namespace {self._config.namespace}, node {self._runtime.node})"
        )

    def tick(self, *_args: Any, **_kwargs: Any) -> float:
        """One pass over the due entries; returns the seconds to sleep.

        A SIGTERM that arrives during the pass is held until the pass ends, so
        every claim made in it is dispatched (never left half-done by an
        exception raised mid-claim); then beat stops.
        """
        self._in_tick = True
        try:
            return self._tick()
        finally:
            self._in_tick = False
            if self._stop_requested:
                raise SystemExit(0)

    def _install_sigterm(self) -> None:
        """Replace Celery's SIGTERM handler, which raises SystemExit wherever beat is."""
        if threading.current_thread() is not threading.main_thread():
            return  # embedded (beat -B in a worker thread): the host owns the signals

        def on_sigterm(_signum: int, _frame: Any) -> None:
            if self._in_tick:
                self._stop_requested = True  # finish the tick first
                logger.info("SIGTERM: stopping after the tick in flight",
                            extra={"action": "beat_stopping"})  # fmt: skip
            else:
                raise SystemExit(0)

        signal.signal(signal.SIGTERM, on_sigterm)

    def _tick(self) -> float:
        interval = float(self._config.tick_interval)
        store = self._runtime.store
        try:
            now = store.now()
            if self._epoch is None:
                self._adopt_epoch(store.epoch())
            self._recheck(now)
        except exceptions.StoreError as exc:
            self._runtime.note_store_error()  # the reconciler's grace
            metrics.event(
                "fail_closed", f"beat cannot reach the store: nothing claimed ({exc})",
                level=logging.WARNING, labels={"phase": "tick_read"}, exc_info=exc,
            )  # fmt: skip
            return interval
        if not self._heap_ready:
            self._due = []
            for name, entry in self.schedule.items():
                self._push(name, entry, now)
            self._heap_ready = True
        popped: list[tuple[str, Any]] = []
        while self._due and self._due[0][0] <= now:
            _, name = heapq.heappop(self._due)
            entry = self.schedule.get(name)
            if entry is not None:
                popped.append((name, entry))
        try:
            self._load_watermarks([name for name, _ in popped], now)
        except exceptions.StoreError as exc:
            self._runtime.note_store_error()  # the reconciler's grace
            for name, entry in popped:
                self._push(name, entry, now)
            metrics.event(
                "fail_closed", f"beat cannot read the watermarks: nothing claimed ({exc})",
                level=logging.WARNING, labels={"phase": "tick_read"}, exc_info=exc,
            )  # fmt: skip
            return interval
        plans = [p for name, entry in popped if (p := self._plan(name, entry, now)) is not None]
        self._claim_and_dispatch(plans, now)
        self._report_skips()
        for name, entry in popped:
            self._push(name, entry, now)
        if self._sweep():
            return 0.0  # more delayed jobs are due: tick again at once
        if self._due:
            return max(0.0, min(interval, (self._due[0][0] - now).total_seconds()))
        return interval

    def _sweep(self) -> bool:
        """Dispatch due delayed jobs, after the slots; whether more may be due.

        Claims move them ``PENDING → SCHEDULED`` in ``run_at`` order, in
        batches of :data:`SWEEP_BATCH` (each job is claimed by one node), and
        each batch is dispatched before the next is claimed, so a SIGTERM
        leaves no claimed job behind. A claim that errors after the store
        applied it leaves its jobs ``SCHEDULED`` for the reconciler to replay.
        """
        runtime = self._runtime
        for _ in range(SWEEP_MAX_BATCHES):
            if self._stop_requested:
                return False
            try:
                claimed = runtime.store.claim_due(SWEEP_BATCH, node=runtime.node, reason="sweep")
            except exceptions.StoreError as exc:
                self._runtime.note_store_error()  # the reconciler's grace
                metrics.event(
                    "fail_closed", f"delayed-job sweep cannot claim: nothing dispatched ({exc})",
                    level=logging.WARNING, labels={"phase": "sweep_claim"}, exc_info=exc,
                )  # fmt: skip
                return False
            if claimed:
                runtime.dispatcher.dispatch_many(claimed, reason="sweep")
            if len(claimed) < SWEEP_BATCH:
                return False
        return True

    def sync(self) -> None:
        """Nothing to persist locally: the store holds every claim and watermark."""

    # -- internals -----------------------------------------------------------------------

    def _push(self, name: str, entry: Any, now: datetime) -> None:
        after = self._settled.get(name, now - timedelta(seconds=self._config.window_lookback))
        upcoming = slots.next_slot(entry.schedule, after, tz=self._tz, entry=name)
        if upcoming is not None:
            heapq.heappush(self._due, (upcoming, name))

    def _policy(self, name: str, entry: Any) -> EntryPolicy:
        policy = self._policies.get(name)
        if policy is None:
            task = self.app.tasks.get(entry.task)
            policy = self._policies[name] = EntryPolicy.of(name, entry, self._config, task)
        return policy

    def _load_watermarks(self, names: list[str], now: datetime) -> None:
        """Start entries this node has not settled lately from their store watermark.

        Slots at or below an entry's watermark are decided (claimed, or skipped
        by whoever claimed a newer one), so a restarted node, or one that fell
        behind, neither re-plans nor counts them.
        """
        behind = now - timedelta(seconds=2 * self._config.tick_interval)
        stale = [n for n in names if (s := self._settled.get(n)) is None or s < behind]
        if not stale:
            return
        for name, mark in self._runtime.store.watermarks(stale).items():
            if mark > self._settled.get(name, mark - timedelta(seconds=1)):
                self._settled[name] = mark

    def _plan(self, name: str, entry: Any, now: datetime) -> _Plan | None:
        """The slots of ``entry`` due by ``now`` this node has not settled, and which to claim.

        Slots that left the window unclaimed since this node settled the
        entry are counted (``where=window``) and settled.
        """
        lookback = now - timedelta(seconds=self._config.window_lookback)
        settled = self._settled.get(name)
        if settled is not None and settled < lookback:
            fallen = slots.slots_between(entry.schedule, settled, lookback, tz=self._tz, entry=name)
            if fallen:  # a lower bound when there were more than slots.DEFAULT_LIMIT
                self._skipped(name, fallen, "window")
            self._settled[name] = settled = lookback
        start = lookback if settled is None else settled
        due = slots.slots_between(entry.schedule, start, now, tz=self._tz, entry=name)
        if not due:
            return None
        if len(due) == slots.DEFAULT_LIMIT:  # truncated: the latest slot is further on
            latest = slots.latest_slot(entry.schedule, now, tz=self._tz, entry=name)
            if latest is not None and latest > due[-1]:
                due.append(latest)
        plan = _Plan(name, start=start, due=due)
        unprovable = [f for f in due if self._floor is not None and f <= self._floor]
        if unprovable:
            self._skipped(name, unprovable, self._floor_reason)
        provable = due[len(unprovable) :]
        if provable:
            claim, skipped = self._select(name, entry, provable, now)
            if skipped:
                self._skipped(name, skipped, "catchup")
            plan.claims = [self._occurrence(name, entry, fire) for fire in claim]
        return plan

    def _skipped(self, name: str, fires: list[datetime], where: str) -> None:
        """Note skipped slots: logged per entry at debug, reported once per tick.

        The reconciler's own entry is not counted: a pass that is not needed
        again after downtime is no lost work.
        """
        if name == RECONCILE_TASK:
            return
        logger.debug(
            "%s: %d slot(s) from %s to %s skipped (%s)", name, len(fires), fires[0].isoformat(),
            fires[-1].isoformat(), where,
            extra={"action": "slot_skipped_entry", "entry": name, "where": where,
                   "count": len(fires), "first": fires[0].isoformat(),
                   "last": fires[-1].isoformat()},
        )  # fmt: skip
        self._skips.setdefault(where, []).append((name, fires[0], fires[-1], len(fires)))

    def _report_skips(self) -> None:
        """One ``slot_skipped`` event per reason per tick, counting every skipped slot."""
        for where, skips in self._skips.items():
            total = sum(n for *_, n in skips)
            name, first, last, _ = skips[0]
            why = _WHY[where]
            more = f" and {len(skips) - 1} more entries" if len(skips) > 1 else ""
            metrics.event(
                "slot_skipped",
                f"{total} slot(s) skipped ({why}): {name} from {first.isoformat()} to "
                f"{last.isoformat()}{more}",
                labels={"where": where}, count=total, entry=name, entries=len(skips),
                first=first.isoformat(), last=last.isoformat(),
            )  # fmt: skip
        self._skips.clear()

    def _select(
        self, name: str, entry: Any, due: list[datetime], now: datetime
    ) -> tuple[list[datetime], list[datetime]]:
        policy = self._policy(name, entry)
        catchup, max_lateness = policy.catchup, policy.max_lateness
        # "none": only what fell due since the previous tick; nothing missed is caught up.
        on_time = now - timedelta(seconds=self._config.tick_interval)
        if max_lateness is not None:
            too_late = [f for f in due if (now - f).total_seconds() > max_lateness]
            due = [f for f in due if f not in too_late]
        else:
            too_late = []
        if catchup == "all":  # the newest ones, as "latest" is the newest one
            keep = len(due) - self._config.catchup_limit
            return due[max(0, keep) :], too_late + due[: max(0, keep)]
        if catchup == "none":
            claim = [f for f in due if f >= on_time]
            return claim, too_late + [f for f in due if f < on_time]
        return due[-1:], too_late + due[:-1]

    def _occurrence(self, name: str, entry: Any, fire: datetime) -> NewJob:
        options = {
            k: v for k, v in (entry.options or {}).items() if k != ENTRY_OPTIONS and v is not None
        }
        policy = self._policy(name, entry)
        options[GATED_OPTION] = policy.gated
        if policy.gated:
            options[POLICY_OPTION] = dict(policy.task_policy)
        deadline = policy.deadline
        new = NewJob(
            JobRef.occurrence(occurrence_id(self._runtime.store.namespace, name, fire)),
            entry.task, State.SCHEDULED, node=self._runtime.node, args=list(entry.args or ()),
            kwargs=dict(entry.kwargs or {}), options=options, entry=name, fire_time=fire,
            deadline=None if deadline is None else fire + timedelta(seconds=deadline),
            reason="beat claim",
        )  # fmt: skip
        # Signed here, not only by the store: a won claim is dispatched as built from this.
        signer = self._runtime.signer
        return new if signer is None else signer.sign_new(new)

    def _claim_and_dispatch(self, plans: list[_Plan], now: datetime) -> None:
        """Claim the planned slots in batches, dispatch the won ones, settle what is decided.

        A claim that failed on a store error is planned again by the next tick
        inside the window (fail closed); see :class:`_Plan`.
        """
        claims = [(plan, new) for plan in plans for new in plan.claims]
        for i in range(0, len(claims), CLAIM_BATCH):
            won = self._claim_batch(claims[i : i + CLAIM_BATCH], now)
            if self._reconcile_runner is not None:
                for job in [job for job in won if job.entry == RECONCILE_TASK]:
                    won.remove(job)
                    self._reconcile_runner.start(job)
            if won:
                self._runtime.dispatcher.dispatch_many(won, reason="beat")
        for plan in plans:
            self._settled[plan.name] = plan.settle_to()

    def _claim_batch(self, batch: list[tuple[_Plan, NewJob]], now: datetime) -> list[jobs.Job]:
        """Create-if-absent the batch; the jobs this node won (``SCHEDULED``, its rev).

        Brief: the store answers with statuses only, and a won job is built
        here from the request (its ``rev`` is ours); the ``DISPATCHED`` CAS
        returns the stored record, and that is what is published.
        """
        provable = []
        for plan, new in batch:  # a loss found earlier in this tick moved the floor
            if self._floor is not None and _fire(new) <= self._floor:
                self._skipped(plan.name, [_fire(new)], self._floor_reason)
            else:
                provable.append((plan, new))
        if not provable:
            return []
        # One read back per claim whose answer was lost: a tick does not wait out an outage.
        results = settle.create_many(
            self._runtime.store, [new for _, new in provable], epoch=self._epoch, brief=True,
            tries=1,
        )  # fmt: skip
        error = results[0].error
        if error is not None:
            self._runtime.note_store_error()  # the reconciler's grace
            failed = sum(1 for result in results if result.status is None)
            if failed:
                metrics.event(
                    "fail_closed", f"{failed} claim(s) failed on a store error: "
                    "not dispatched, retried next tick", level=logging.WARNING,
                    labels={"phase": "claim_write"}, exc_info=error,
                )  # fmt: skip
        won: list[jobs.Job] = []
        lost: list[tuple[_Plan, NewJob]] = []
        taken: list[tuple[NewJob, jobs.Job | None]] = []
        for (plan, new), result in zip(provable, results, strict=True):
            if result.status is None:  # lost, and no record read back
                plan.failed.append(_fire(new))
            elif result.status is CreateStatus.EPOCH_MISMATCH:
                lost.append((plan, new))
            elif result.status is CreateStatus.CREATED:
                won.append(result.job or jobs.job_from_new(new, now))
                self._recent.append((new.ref, _fire(new)))
            elif result.applied and result.job is not None:  # our record, as the store holds it
                if result.job.state is State.SCHEDULED:
                    won.append(result.job)
                    self._recent.append((new.ref, _fire(new)))
            else:
                logger.debug(
                    "%s at %s already claimed (%s)", plan.name, new.fire_time, result.status.value,
                    extra={"action": "slot_already_claimed", "entry": plan.name},
                )  # fmt: skip
                if result.status is CreateStatus.EXISTS:
                    taken.append((new, result.job))
        if lost:
            self._store_lost(lost)
        if taken:
            self._check_conflicts(taken, now)
        return won

    def _check_conflicts(self, taken: list[tuple[NewJob, jobs.Job | None]], now: datetime) -> None:
        """Compare slots found claimed with this node's entries; report another definition.

        Each entry is compared at most once every :data:`CONFLICT_RECHECK`
        seconds, and at most :data:`CONFLICT_CHECKS_PER_TICK` records are read
        per tick (a brief claim answers without the record).
        """
        reads = 0
        for new, found in taken:
            record = found
            entry = _fire_entry(new)
            checked = self._conflict_checked.get(entry)
            if checked is not None and (now - checked).total_seconds() < CONFLICT_RECHECK:
                continue
            if record is None:
                if reads >= CONFLICT_CHECKS_PER_TICK:
                    continue
                reads += 1
                try:
                    record = self._runtime.store.get(new.ref)
                except exceptions.StoreError:
                    continue  # compared on a later tick
                if record is None:
                    continue  # purged meanwhile
            self._conflict_checked[entry] = now
            if record.task != new.task or (
                # a Celery retry may have given a later attempt other arguments
                record.attempt == 0 and (record.args, record.kwargs) != (new.args, new.kwargs)
            ):
                self._report_conflict(new, record)

    def _report_conflict(self, new: NewJob, record: jobs.Job) -> None:
        entry = _fire_entry(new)
        what = (
            f"task {record.task} instead of {new.task}"
            if record.task != new.task
            else f"task {record.task} with other arguments"
        )
        claimer = record.history[0].node if record.history else record.node
        metrics.event(
            "claim_conflict", f"beat entry {entry!r}: the slot {_fire(new).isoformat()} was "
            f"claimed as {what} (node {claimer}): another app defines this entry name "
            "differently on this namespace, and this node's job does not run",
            level=logging.WARNING, entry=entry, job_id=new.ref.id, task=new.task,
            claimed_task=record.task, claimed_by=claimer,
        )  # fmt: skip
        note = (
            f"claim conflict: node {self._runtime.node} defines beat entry {entry!r} as "
            f"{new.task}{' with other arguments' if record.task == new.task else ''}; "
            "its job did not run"
        )
        # The record says it too, for whoever reads it later; a store error leaves the
        # warning above, and the next report (CONFLICT_RECHECK) tries again.
        with contextlib.suppress(exceptions.StoreError):
            self._runtime.store.annotate(
                record.ref, node=self._runtime.node, reason=note, op_id=jobs.new_token()
            )

    def _store_lost(self, lost: list[tuple[_Plan, NewJob]]) -> None:
        """Claims refused for an epoch mismatch: skip them, count, and adopt the new epoch."""
        metrics.event(
            "store_loss_detected", f"the store lost its data (epoch changed): {len(lost)} "
            "slot(s) can no longer be proven unclaimed and are skipped",
            level=logging.ERROR, labels={"where": "epoch"}, sentry=True,
        )  # fmt: skip
        for plan, new in lost:
            self._skipped(plan.name, [_fire(new)], "store_loss")
        self._floor_reason = "store_loss"
        try:
            self._adopt_epoch(self._runtime.store.epoch())
        except exceptions.StoreError:
            self._epoch = None  # the next tick reads it again; until then nothing is claimed

    def _adopt_epoch(self, epoch: str) -> None:
        """Hold ``epoch``; no slot at or before its birth plus ``max_skew`` is ever claimed."""
        self._epoch = epoch
        born = jobs.epoch_born(epoch)
        if born is not None:
            self._raise_floor(born + timedelta(seconds=self._config.max_skew))

    def _raise_floor(self, floor: datetime) -> None:
        if self._floor is None or floor > self._floor:
            self._floor = floor

    def _recheck(self, now: datetime) -> None:
        """Re-read this node's newest claims; one that is gone shows a store loss."""
        horizon = now - timedelta(seconds=self._config.window_lookback)
        while self._recent and self._recent[0][1] < horizon:
            self._recent.popleft()
        sample = list(self._recent)[-RECHECK_PER_TICK:]
        store = self._runtime.store
        missing = [ref for ref, _ in sample if store.get(ref) is None]
        if not missing:
            return
        self._recent.clear()
        self._floor_reason = "store_loss"
        self._raise_floor(now + timedelta(seconds=self._config.max_skew))
        # A store that forgot only its last writes (Redis appendfsync everysec, a lagging
        # replica) kept its epoch: replacing it makes every other node's next claim an
        # epoch mismatch, so they stop short of the forgotten slots too. After a restart
        # without persistence the epoch is gone already, and this takes the new one.
        self._adopt_epoch(store.epoch(replace=self._epoch))
        metrics.event(
            "store_loss_detected", f"{len(missing)} of this node's recent claims are gone from "
            f"the store (e.g. {missing[0]}): slots up to {self._floor} "
            "are skipped", level=logging.ERROR, labels={"where": "recheck"}, sentry=True,
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class EntryPolicy:
    """An entry's settings: ``options["exactonce"]`` over the app's ``exactonce_*`` defaults.

    ``catchup``       ``latest`` | ``all`` | ``none`` (default ``exactonce_catchup``)
    ``max_lateness``  seconds after its fire time a slot is still claimed (default
                      ``exactonce_max_lateness``; ``None``: no bound but the window)
    ``deadline``      seconds after its fire time an occurrence may still be
                      published; past it the message expires (``None``: no deadline)
    ``gated``         whether the workers run the task as an ``ExactOnceTask``.
                      Beat tells by itself when it imports the task; for a task
                      it does not import, the entry must say (``True``/``False``),
                      or beat refuses to start: guessing "plain" would write
                      each occurrence ``PUBLISHED`` and the workers' gate would
                      refuse to run it.
    ``dispatch_timeout``, ``dispatch_deadline``, ``running_timeout``, ``redispatch``,
    ``rerun``         the task's reconciler policy, as its ``exactonce_*``
                      attributes give it (gated entries only); beat reads the
                      attributes of a task it imports, and these override them.
    """

    catchup: config_module.Catchup
    max_lateness: float | None
    deadline: float | None
    gated: bool = False
    task_policy: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(
        cls, name: str, entry: Any, config: config_module.ExactOnceConfig, task: Any = None
    ) -> EntryPolicy:
        """The entry's policy; a :class:`ConfigurationError` naming the entry if it is wrong.

        ``task`` is the entry's task as this process registers it, or ``None``.
        """
        overrides = (entry.options or {}).get(ENTRY_OPTIONS) or {}
        where = f"beat entry {name!r}: options[{ENTRY_OPTIONS!r}]"
        if not isinstance(overrides, dict):
            raise exceptions.ConfigurationError(f"{where} must be a dict", setting="beat_schedule")
        unknown = sorted(set(overrides) - set(ENTRY_KEYS))
        if unknown:
            raise exceptions.ConfigurationError(
                f"{where}: unknown key(s) {', '.join(map(repr, unknown))} "
                f"(known: {', '.join(ENTRY_KEYS)})",
                setting="beat_schedule",
            )
        try:
            catchup = config_module.as_catchup(overrides.get("catchup", config.catchup))
        except exceptions.ConfigurationError as exc:
            raise exceptions.ConfigurationError(f"{where}: {exc}", setting="beat_schedule") from exc
        lateness = _seconds(
            where, "max_lateness", overrides.get("max_lateness", config.max_lateness)
        )
        gated = _gated(name, entry, where, overrides.get("gated"), task)
        policy = _entry_task_policy(where, overrides, config, task if gated else None, gated)
        return cls(
            catchup, lateness, _seconds(where, "deadline", overrides.get("deadline")), gated, policy
        )


#: The keys of an entry's ``options["exactonce"]``.
ENTRY_KEYS = (
    "catchup", "max_lateness", "deadline", "gated", *TASK_TIMEOUTS, *TASK_FLAGS,
)  # fmt: skip


def _gated(name: str, entry: Any, where: str, declared: object, task: Any) -> bool:
    """Whether the entry's task is gated: what beat sees of it, or what the entry declares."""
    if declared is not None and not isinstance(declared, bool):
        raise exceptions.ConfigurationError(
            f"{where}['gated'] must be True or False, got {declared!r}", setting="beat_schedule"
        )
    if task is None:
        if declared is None:
            raise exceptions.ConfigurationError(
                f"beat entry {name!r}: task {entry.task!r} is not registered in this beat "
                "process, so beat cannot tell whether the workers gate it. Import the task's "
                "module in beat (app.conf.imports or include), or declare it on the entry: "
                f"options={{{ENTRY_OPTIONS!r}: {{'gated': True}}}} for an ExactOnceTask, "
                "{'gated': False} for a plain task",
                setting="beat_schedule",
            )
        return declared
    actual = isinstance(task, ExactOnceTask)
    if declared is not None and declared is not actual:
        kind = "an ExactOnceTask" if actual else "a plain task"
        raise exceptions.ConfigurationError(
            f"{where}['gated'] is {declared}, but task {entry.task!r} is {kind} here",
            setting="beat_schedule",
        )
    return actual


def _entry_task_policy(
    where: str,
    overrides: Mapping[str, Any],
    config: config_module.ExactOnceConfig,
    task: Any,
    gated: bool,
) -> dict[str, Any]:
    """The reconciler policy an entry's occurrences store: the task's, then the entry's."""
    given = [key for key in (*TASK_TIMEOUTS, *TASK_FLAGS) if overrides.get(key) is not None]
    if not gated:
        if given:
            raise exceptions.ConfigurationError(
                f"{where}: {', '.join(given)} apply to gated tasks only", setting="beat_schedule"
            )
        return {}
    policy = task_policy(task) if task is not None else {}
    for key in TASK_FLAGS:
        value = overrides.get(key)
        if value is not None and not isinstance(value, bool):
            raise exceptions.ConfigurationError(
                f"{where}[{key!r}] must be True or False, got {value!r}", setting="beat_schedule"
            )
        if value is not None:
            policy[key] = value
    for key in TASK_TIMEOUTS:
        seconds = _seconds(where, key, overrides.get(key))
        if seconds is not None:
            policy[key] = seconds
    timeouts = {key: policy[key] for key in TASK_TIMEOUTS if key in policy}
    if timeouts:
        try:  # the rules the settings follow (dispatch_deadline >= dispatch_timeout...)
            dataclasses.replace(config, **timeouts)
        except exceptions.ConfigurationError as exc:
            raise exceptions.ConfigurationError(f"{where}: {exc}", setting="beat_schedule") from exc
    return policy


def _seconds(where: str, key: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise exceptions.ConfigurationError(
            f"{where}[{key!r}] must be a number of seconds >= 0, got {value!r}",
            setting="beat_schedule",
        )
    return float(value)


#: Why slots were skipped, by the ``where`` label of ``slot_skipped``.
_WHY = {
    "catchup": "the catch-up policy",
    "window": "they left window_lookback unclaimed",
    "unprovable": "at or before the store epoch's birth + max_skew: a new (or wiped) store",
    "store_loss": "store loss: unprovable",
}


def _label(name: object) -> str:
    """An entry name for a message: its repr, cut short if long."""
    text = repr(name)
    return text if len(text) <= 60 else f"{text[:40]}…"


def _fire_entry(new: NewJob) -> str:
    """An occurrence's entry name (every claim beat builds has one)."""
    assert new.entry is not None  # noqa: S101
    return new.entry


def _fire(new: NewJob) -> datetime:
    """An occurrence's fire time (every claim beat builds has one)."""
    assert new.fire_time is not None  # noqa: S101
    return new.fire_time


@dataclasses.dataclass
class _Plan:
    """One entry's work in a tick: its due slots, those to claim, and how far it settles.

    Every due slot is decided (claimed, found claimed, or skipped and counted)
    except those whose claim failed on a store error: the entry settles up to
    the last slot before the first failure, so the next tick tries that one
    again (fail closed) and nothing decided is counted twice.
    """

    name: str
    start: datetime
    due: list[datetime]
    claims: list[NewJob] = dataclasses.field(default_factory=list)
    failed: list[datetime] = dataclasses.field(default_factory=list)

    def settle_to(self) -> datetime:
        if not self.failed:
            return self.due[-1]
        first = min(self.failed)
        return max([self.start, *(f for f in self.due if f < first)])
