"""ExactOnceScheduler: leaderless beat; every node ticks, the store decides who dispatches.

Load it with ``beat_scheduler = "exactonce"`` (or ``celery beat -S exactonce``).
It reads the ordinary ``beat_schedule``. Every node derives the same nominal
slots (:mod:`celery_exactonce.slots`), claims each due one with a
create-if-absent that also checks the store epoch and advances the entry's
durable watermark, and dispatches the claims it won through the dispatch path
(DESIGN.md section 4, "Beat").

Per tick, for each entry whose next slot is due (a heap keyed by next slot:
the cost follows the due entries, not all of them):

* slots in ``(last settled, store time]`` and within ``window_lookback`` are
  due. Due-ness is judged on the store's clock, never this node's, so a node
  never claims a slot before ``store time >= fire_time`` (DESIGN allows up to
  ``max_skew`` early; judging on store time needs no such allowance);
* after downtime, the entry's catch-up policy picks which missed slots to
  claim (``latest`` by default, ``all`` up to ``catchup_limit``, ``none``);
  ``max_lateness`` skips slots that are too late; every skipped slot is counted;
* a claim that fails on a store error is not settled: the next tick inside
  the window tries again (fail closed), and a slot that falls out of the
  window is counted as skipped;
* a claim refused for an epoch mismatch means the store lost its data: the
  slot is skipped and counted (it can no longer be proven unclaimed), and the
  node adopts the store's new epoch.

Per-entry overrides live under ``options["exactonce"]``:
``{"catchup": "all", "max_lateness": 600}``.

SIGTERM during a tick is held until the tick ends: its claims are dispatched,
then beat exits. Not yet (next steps of the scheduler issue): batched claims,
re-checking this node's own recent claims after a store loss, the delayed-job
sweep and the reconciler thread.
"""

from __future__ import annotations

import heapq
import logging
import signal
import threading
from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from celery import beat

from celery_exactonce import config as config_module
from celery_exactonce import exceptions, jobs, keys, metrics, slots
from celery_exactonce.dispatch import GATED_OPTION
from celery_exactonce.jobs import CreateStatus, JobRef, NewJob
from celery_exactonce.runtime import Runtime, runtime_for
from celery_exactonce.states import State
from celery_exactonce.stores import redact_url
from celery_exactonce.task import ExactOnceTask

logger = logging.getLogger(__name__)

#: Entry option key holding per-entry overrides.
ENTRY_OPTIONS = "exactonce"


def occurrence_id(namespace: str, entry: str, fire_time: datetime) -> str:
    """The job id (Celery ``task_id``) of an occurrence: its idempotency key."""
    return keys.idempotency_key(entry, fire_time, namespace)


class ExactOnceScheduler(beat.Scheduler):  # type: ignore[misc]  # celery is untyped
    """A ``celery.beat.Scheduler`` that dispatches each occurrence once across all nodes."""

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        self._runtime: Runtime = runtime_for(app)
        self._config = self._runtime.config
        self._tz = ZoneInfo(str(app.timezone))
        self._epoch: str | None = None
        self._settled: dict[str, datetime] = {}
        self._due: list[tuple[datetime, str]] = []
        self._heap_ready = False
        self._in_tick = False
        self._stop_requested = False
        super().__init__(app, *args, **kwargs)
        self._install_sigterm()

    # -- celery.beat.Scheduler interface ---------------------------------------------

    def setup_schedule(self) -> None:
        self.merge_inplace(self.app.conf.beat_schedule)
        now = self._runtime.store.now()
        for name, entry in self.schedule.items():
            slots.validate_schedule(name, entry.schedule, self._tz, at=now)
            self._policy(name, entry)
        self._due = []
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
                self._epoch = store.epoch()
        except exceptions.StoreError as exc:
            metrics.event(
                "fail_closed", f"beat cannot reach the store: nothing claimed ({exc})",
                level=logging.WARNING, labels={"phase": "tick_read"}, exc_info=exc,
            )  # fmt: skip
            return interval
        if not self._heap_ready:
            for name, entry in self.schedule.items():
                self._push(name, entry, now)
            self._heap_ready = True
        horizon = now
        while self._due and self._due[0][0] <= horizon:
            _, name = heapq.heappop(self._due)
            entry = self.schedule.get(name)
            if entry is None:
                continue
            self._tick_entry(name, entry, now)
            self._push(name, entry, now)
        if self._due:
            return max(0.0, min(interval, (self._due[0][0] - horizon).total_seconds()))
        return interval

    def sync(self) -> None:
        """Nothing to persist locally: the store holds every claim and watermark."""

    # -- internals -----------------------------------------------------------------------

    def _push(self, name: str, entry: Any, now: datetime) -> None:
        after = self._settled.get(name, now - timedelta(seconds=self._config.window_lookback))
        upcoming = slots.next_slot(entry.schedule, after, tz=self._tz, entry=name)
        if upcoming is not None:
            heapq.heappush(self._due, (upcoming, name))

    def _policy(self, name: str, entry: Any) -> tuple[str, float | None]:
        overrides = (entry.options or {}).get(ENTRY_OPTIONS) or {}
        if not isinstance(overrides, dict):
            raise exceptions.ConfigurationError(
                f"beat entry {name!r}: options[{ENTRY_OPTIONS!r}] must be a dict",
                setting="beat_schedule",
            )
        catchup = config_module.as_catchup(overrides.get("catchup", self._config.catchup))
        lateness = overrides.get("max_lateness", self._config.max_lateness)
        return catchup, None if lateness is None else float(lateness)

    def _tick_entry(self, name: str, entry: Any, now: datetime) -> None:
        lookback = now - timedelta(seconds=self._config.window_lookback)
        start = max(self._settled.get(name, lookback), lookback)
        due = slots.slots_between(entry.schedule, start, now, tz=self._tz, entry=name)
        if not due:
            return
        if len(due) == slots.DEFAULT_LIMIT:  # truncated: the latest slot is further on
            latest = slots.latest_slot(entry.schedule, now, tz=self._tz, entry=name)
            if latest is not None and latest > due[-1]:
                due.append(latest)
        claim, skipped = self._select(name, entry, due, now)
        for fire in skipped:
            metrics.event(
                "slot_skipped", f"{name} at {fire.isoformat()} skipped (catch-up policy)",
                labels={"where": "catchup"}, entry=name, fire_time=fire.isoformat(),
            )  # fmt: skip
        for fire in claim:
            if not self._claim(name, entry, fire):
                return  # fail closed: not settled, the next tick retries inside the window
        self._settled[name] = due[-1]

    def _select(
        self, name: str, entry: Any, due: list[datetime], now: datetime
    ) -> tuple[list[datetime], list[datetime]]:
        catchup, max_lateness = self._policy(name, entry)
        # "none": only what fell due since the previous tick; nothing missed is caught up.
        on_time = now - timedelta(seconds=self._config.tick_interval)
        if max_lateness is not None:
            too_late = [f for f in due if (now - f).total_seconds() > max_lateness]
            due = [f for f in due if f not in too_late]
        else:
            too_late = []
        if catchup == "all":
            return due[: self._config.catchup_limit], too_late + due[self._config.catchup_limit :]
        if catchup == "none":
            claim = [f for f in due if f >= on_time]
            return claim, too_late + [f for f in due if f < on_time]
        return due[-1:], too_late + due[:-1]

    def _claim(self, name: str, entry: Any, fire: datetime) -> bool:
        """Claim and dispatch one slot; ``False`` when the store failed (not settled)."""
        runtime = self._runtime
        options = {
            k: v for k, v in (entry.options or {}).items() if k != ENTRY_OPTIONS and v is not None
        }
        task = self.app.tasks.get(entry.task)
        options[GATED_OPTION] = isinstance(task, ExactOnceTask)
        new = NewJob(
            JobRef.occurrence(occurrence_id(runtime.store.namespace, name, fire)),
            entry.task, State.SCHEDULED, node=runtime.node, args=list(entry.args or ()),
            kwargs=dict(entry.kwargs or {}), options=options, entry=name, fire_time=fire,
            reason="beat claim",
        )  # fmt: skip
        try:
            result = runtime.store.create(new, epoch=self._epoch)
        except exceptions.StoreError as exc:
            job = self._read_back_claim(new)
            if job is None:
                metrics.event(
                    "fail_closed", f"claim of {name} at {fire.isoformat()} failed: not dispatched",
                    level=logging.WARNING, labels={"phase": "claim_write"}, exc_info=exc,
                    entry=name,
                )  # fmt: skip
                return False
            result = jobs.CreateResult(CreateStatus.EXISTS, job)
        if result.status is CreateStatus.EPOCH_MISMATCH:
            metrics.event(
                "store_loss_detected", f"the store lost its data (epoch changed); {name} at "
                f"{fire.isoformat()} can no longer be proven unclaimed and is skipped",
                level=logging.ERROR, labels={"where": "epoch"}, sentry=True, entry=name,
            )  # fmt: skip
            metrics.COUNTERS.incr("slot_skipped", {"where": "store_loss"})
            self._epoch = result.epoch or runtime.store.epoch()
            return True
        job = result.job
        if job is not None and job.rev == new.rev and job.state is State.SCHEDULED:
            runtime.dispatcher.dispatch(job, reason="beat")
            return True
        logger.debug(
            "%s at %s already claimed (%s)", name, fire.isoformat(), result.status.value,
            extra={"action": "slot_already_claimed", "entry": name},
        )  # fmt: skip
        return True

    def _read_back_claim(self, new: NewJob) -> jobs.Job | None:
        try:
            job = self._runtime.store.get(new.ref)
        except exceptions.StoreError:
            return None
        return job
