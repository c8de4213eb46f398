"""Beat on django-celery-beat's ``PeriodicTask`` rows, on any number of nodes.

``celery beat -S exactonce-django`` (or ``beat_scheduler = "exactonce-django"``)
runs the rows an admin edits with the guarantee ``beat_schedule`` entries have
under ``-S exactonce``: each occurrence is claimed in the store by one node and
dispatched once, with no leader.

* **Rows as entries.** Every enabled row is an entry named by the row's name
  (:mod:`~celery_exactonce.contrib.periodic_tasks`): interval, crontab (in its
  own ``timezone``), solar and clocked schedules; ``start_time``, ``expires``
  and ``expire_seconds``, ``one_off``; ``queue``, ``exchange``,
  ``routing_key``, ``priority``, ``headers``; ``args`` and ``kwargs`` JSON.
* **Changes while beat runs.** Each tick reads django-celery-beat's change
  marker (one row); when it moved, or every five minutes, the rows are read
  again. An edited schedule moves the entry's future slots, and no slot at or
  below its watermark fires again; a disabled or deleted row fires no more; a
  renamed row is a new entry, which starts after the row's ``last_run_at`` and
  after every slot claimed under another name, counted or not yet
  (:mod:`~celery_exactonce.contrib.row_names`).
  A row beat cannot run (arguments that are not
  JSON, a task beat refuses) is left out with an ``entry_refused`` error; the
  others keep running.
* **Runs counted once.** ``last_run_at`` and ``total_run_count`` advance once
  per occurrence, by a guarded ``UPDATE`` from each node that decided its slot,
  so the admin shows the truth. A one-off row (``one_off``, or clocked) fires
  its one slot across all nodes and is then disabled, once.
* **Settings entries.** ``beat_schedule`` is written into rows at start-up, as
  django-celery-beat does, and their ``options["exactonce"]`` apply to those
  rows. An entry no row can hold (an ``at`` or ``bounded`` schedule) runs from
  the settings.

Not here: the slots, the claims and the dispatch, which are the
:class:`~celery_exactonce.beat.scheduler.ExactOnceScheduler`'s.
"""

from __future__ import annotations

import functools
import logging
from datetime import datetime, timedelta
from typing import Any

from celery import beat

from celery_exactonce import startup
from celery_exactonce.beat.entries import ENTRY_OPTIONS, occurrence_id
from celery_exactonce.beat.planner import Plan
from celery_exactonce.beat.scheduler import ExactOnceScheduler
from celery_exactonce.contrib import periodic_tasks
from celery_exactonce.contrib.django.connection import require_immediate
from celery_exactonce.contrib.row_names import RowNames
from celery_exactonce.core import exceptions, slots
from celery_exactonce.core.refs import JobRef
from celery_exactonce.observe import metrics

__all__ = ["DatabaseScheduler"]

#: Most slots of one row a node looks up in the store when it starts after a watermark
#: it did not decide itself (see :meth:`DatabaseScheduler._count_passed`).
PASSED_LIMIT = 100

#: Seconds after which the rows are read again even if the marker did not move
#: (a change made with ``QuerySet.update`` does not move it), as django-celery-beat does.
FULL_READ_INTERVAL = 300.0


def check_start(scheduler: type) -> None:
    """What refuses the scheduler at start: a custom ``Entry``, rows on SQLite not ``IMMEDIATE``.

    Its entries are built from the rows as ``beat_schedule`` entries are
    (Celery's ``ScheduleEntry``); django-celery-beat's ``ModelEntry`` (and a
    subclass a project sets as ``Entry``) is built from a row, and fails
    inside Celery with a ``TypeError``. On SQLite, two beats starting at once
    each write the change marker after reading it (django-celery-beat's
    ``update_changed``): without ``IMMEDIATE`` one of them fails with
    ``database is locked``.
    """
    from django.db import router
    from django_celery_beat.models import PeriodicTask
    from django_celery_beat.schedulers import ModelEntry

    entry = getattr(scheduler, "Entry", beat.ScheduleEntry)
    if issubclass(entry, ModelEntry) or not issubclass(entry, beat.ScheduleEntry):
        raise exceptions.ConfigurationError(
            f"{scheduler.__module__}.{scheduler.__qualname__} sets Entry = "
            f"{entry.__module__}.{entry.__qualname__}: exactonce-django builds its entries from "
            "the rows itself and takes no ModelEntry. Per-row policy goes in the row's headers "
            '({"exactonce": {...}}), what is published in a before_task_publish handler '
            "(docs/howto/migrate-django-celery-beat.md)",
            setting="beat_scheduler",
        )
    alias = router.db_for_write(PeriodicTask)
    require_immediate(alias, "exactonce-django (the periodic tasks' rows)", f"DATABASES[{alias!r}]")


class DatabaseScheduler(ExactOnceScheduler):
    """An :class:`ExactOnceScheduler` whose entries are django-celery-beat's rows."""

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        try:  # before the store is opened: one line, then beat ends
            check_start(type(self))
        except exceptions.ConfigurationError as exc:
            startup.refuse("beat", exc)
        self._rows: dict[str, Any] = {}  # entry name -> the row it was read from
        self._definitions: dict[str, str] = {}  # entry name -> what it was built from
        self._overrides: dict[str, dict[str, Any]] = {}
        self._settings_entries: dict[str, Any] = {}
        self._marker: datetime | None = None
        self._read_at: datetime | None = None
        self._unrecorded: list[tuple[int, datetime, bool]] = []  # (pk, slot, won)
        super().__init__(app, *args, **kwargs)

    # -- celery.beat.Scheduler interface ---------------------------------------------

    #: The names each row was read under (made with the schedule: it raises ``_decided``).
    _row_names: RowNames

    def setup_schedule(self) -> None:
        """Write ``beat_schedule`` into rows, then read every enabled row."""
        self._row_names = RowNames(self._decided, self._config.max_skew)
        self._settings_entries = self._write_settings_entries(self.app.conf.beat_schedule)
        self._setup_entries(self._settings_entries)
        self._refresh(self._runtime.store.now(), force=True)

    def _tick_started(self, now: datetime) -> None:
        """Read the rows again if they changed, and count runs a failed write left, first."""
        self._refresh(now)
        self._record_pending()

    @property
    def info(self) -> str:
        return f"{super().info}\n    . rows -> django_celery_beat.PeriodicTask"

    # -- the rows --------------------------------------------------------------------

    def _write_settings_entries(self, entries: dict[str, Any]) -> dict[str, Any]:
        """Write each settings entry into its row; those no row can hold, to run as they are."""
        kept: dict[str, Any] = {}
        for name, fields in entries.items():
            try:
                options = dict(fields.get("options") or {})
                overrides = options.pop(ENTRY_OPTIONS, None)
                periodic_tasks.write_settings_row(name, self.app, {**fields, "options": options})
            except (ValueError, TypeError, AttributeError):
                kept[name] = fields  # a schedule no row holds: run (or refused) from the settings
                continue
            if overrides:
                self._overrides[name] = dict(overrides)
        return kept

    def _refresh(self, now: datetime, *, force: bool = False) -> None:
        """Read the rows again if the marker moved (or ``force``, or it is time, on store time)."""
        from django.db import DatabaseError, close_old_connections, connection

        due = self._read_at is None or now - self._read_at >= timedelta(seconds=FULL_READ_INTERVAL)
        try:
            if not connection.in_atomic_block:  # never close a caller's transaction
                close_old_connections()
            marker = periodic_tasks.last_change()
            if not (force or due or marker != self._marker):
                return
            rows = periodic_tasks.enabled_rows()
        except DatabaseError as exc:
            metrics.event(
                "schedule_read_failed",
                f"the periodic tasks cannot be read: the schedule stays as it was ({exc})",
                level=logging.WARNING,
                exc_info=exc,
            )
            return
        if self._read_at is None:
            why = "start"
        elif marker != self._marker:
            why = "changed"
        else:
            why = "forced" if force else "periodic"
        self._marker, self._read_at = marker, now
        self._apply(rows, now)
        metrics.event(
            "schedule_reloaded",
            "periodic tasks read (%s): %d row(s) run",
            why,
            len(self._rows),
            why=why,
            rows=len(self._rows),
        )

    def _apply(self, rows: list[Any], now: datetime) -> None:
        """Make the schedule what the rows say: add, replace and remove entries."""
        fresh = {row.name: row for row in rows if row.name not in self._settings_entries}
        for name in [n for n in {**self._definitions, **self._rows} if n not in fresh]:
            self._drop(name)
        spent = timedelta(seconds=self._config.window_lookback)
        for name, row in fresh.items():
            if row.expires is not None and periodic_tasks.aware(row.expires) + spent <= now:
                self._disable(name, row.pk, "expired")  # its last slot is out of the window
            definition = _definition(row, self._overrides.get(name))
            if self._definitions.get(name) == definition:
                if name in self.schedule:
                    self._rows[name] = row
                continue  # unchanged: running, or refused until it changes
            try:
                entry = periodic_tasks.entry_of(row, self._overrides.get(name))
                periodic_tasks.check_task(self.app, name, entry)
                self.update_from_dict({name: entry})
            except Exception as exc:  # one row, whatever is wrong, not beat
                self._drop(name)
                self._definitions[name] = definition  # not refused again until it changes
                self._refused(name, exc)
                continue
            self._rows[name], self._definitions[name] = row, definition
            self._row_names.read(name, row)

    def _load_watermarks(self, due: list[tuple[str, datetime]], now: datetime) -> None:
        """The store watermarks of due entries; the rows read renamed or anew held back.

        A store error raises before anything is kept: the tick claims nothing
        (fail closed), and what the rows' names need is read again next tick
        (:mod:`~celery_exactonce.contrib.row_names`).
        """
        before = {name: self._decided.get(name) for name, _ in due}
        store = self._runtime.store
        self._row_names.load(store)
        super()._load_watermarks(due, now)
        self._count_passed(before, now)
        self._row_names.hold(store, functools.partial(self._skip_held, now))

    def _skip_held(
        self, now: datetime, name: str, before: datetime | None, floor: datetime
    ) -> None:
        """Note the slots of ``name`` after ``before`` up to ``floor`` skipped (``unprovable``)."""
        entry = self.schedule.get(name)
        if entry is None:
            return
        since = now - timedelta(seconds=self._config.window_lookback)
        if before is not None and before > since:
            since = before
        fires = slots.slots_between(entry.schedule, since, floor, tz=self._tz)
        if fires:
            self._claimer.skipped(name, fires, "unprovable", self._policies, entry.task)

    def _count_passed(self, before: dict[str, datetime | None], now: datetime) -> None:
        """Count the claimed slots a row's entry passed over by taking a store watermark.

        The nodes that decided a slot count it, in slot order (the guard of
        :func:`periodic_tasks.record_run`); a node that did not (it was behind,
        or it starts) but counts a later one would leave an earlier count that
        failed on its winner refused when it is tried again. So the slots
        between where this node was (or the row's ``last_run_at``) and the
        watermark are looked up in the store, at most :data:`PASSED_LIMIT`, and
        those claimed are counted first (a store error fails the tick closed).
        Nothing to look up in the steady state: a node that keeps up takes no
        watermark.
        """
        store = self._runtime.store
        for name, was in before.items():
            row, mark, entry = (
                self._rows.get(name),
                self._decided.get(name),
                self.schedule.get(name),
            )
            if row is None or entry is None or mark is None or (was is not None and mark <= was):
                continue
            floor = now - timedelta(seconds=self._config.window_lookback)
            since = max(floor, was or floor)
            if row.last_run_at is not None:
                since = max(since, periodic_tasks.aware(row.last_run_at))
            fires = slots.slots_between(
                entry.schedule, since, mark, tz=self._tz, limit=PASSED_LIMIT
            )
            for fire in fires:
                ref = JobRef.occurrence(occurrence_id(store.namespace, name, fire))
                if store.get(ref) is not None:
                    self._unrecorded.append((row.pk, fire, False))

    def _refused(self, name: str, exc: Exception) -> None:
        """A row beat cannot run, named and counted; the others keep running."""
        if isinstance(exc, exceptions.ConfigurationError):
            text = str(exc)
        else:  # a row the checks did not foresee: still that row's, not beat's
            text = f"periodic task {name!r}: {type(exc).__name__}: {exc}"
        metrics.event(
            "entry_refused",
            f"{text}: this row does not run; the others do",
            level=logging.ERROR,
            sentry=True,
            entry=name,
        )

    def _drop(self, name: str) -> None:
        self._rows.pop(name, None)
        self._definitions.pop(name, None)
        if self.schedule.pop(name, None) is not None:
            self._forget(name)

    # -- what beat writes back ---------------------------------------------------------

    def _claimed(self, plans: list[Plan]) -> None:
        """Count each slot found claimed in its row; disable a one-off that has run."""
        for plan in plans:
            row = self._rows.get(plan.name)
            if row is None or not plan.claimed:
                continue
            won = set(plan.won)
            self._unrecorded.extend((row.pk, fire, fire in won) for fire in plan.claimed)
            if periodic_tasks.is_one_off(row):
                self._disable(row.name, row.pk, "one-off ran")
        self._record_pending()

    def _record_pending(self) -> None:
        """Write the runs not yet counted, oldest first; a failed write is tried next tick."""
        from django.db import DatabaseError

        pending, self._unrecorded = sorted(self._unrecorded, key=lambda run: run[1]), []
        for i, (pk, fire, won) in enumerate(pending):
            try:
                periodic_tasks.record_run(pk, fire, won=won)
            except DatabaseError as exc:
                self._unrecorded = pending[i:]
                metrics.event(
                    "row_update_failed",
                    f"{len(pending) - i} run(s) not yet counted in their rows: tried again "
                    f"next tick ({exc})",
                    level=logging.WARNING,
                )
                return

    def _disable(self, name: str, pk: int, why: str) -> None:
        from django.db import DatabaseError

        try:
            disabled = periodic_tasks.disable(pk)
        except DatabaseError as exc:
            metrics.event(
                "row_update_failed",
                f"periodic task {name!r} ({why}) could not be disabled: "
                f"its slots have run all the same ({exc})",
                level=logging.WARNING,
            )
            return
        if disabled:
            metrics.event("row_disabled", f"periodic task {name!r} disabled: {why}")


def _definition(row: Any, overrides: dict[str, Any] | None) -> str:
    """What an entry is built from, to tell a changed row from one saved unchanged."""
    fields = (
        row.task,
        row.args,
        row.kwargs,
        row.queue,
        row.exchange,
        row.routing_key,
        row.priority,
        row.headers,
        row.expires,
        row.expire_seconds,
        row.one_off,
        row.start_time,
        row.date_changed if row.one_off else None,
        _fields(row, "interval", "every", "period"),
        _fields(row, "crontab", "minute", "hour", "day_of_month", "month_of_year", "day_of_week"),
        row.crontab_id and str(getattr(periodic_tasks.related(row, "crontab"), "timezone", "")),
        _fields(row, "solar", "event", "latitude", "longitude"),
        _fields(row, "clocked", "clocked_time"),
        sorted((overrides or {}).items()),
    )
    return repr(fields)


def _fields(row: Any, kind: str, *names: str) -> tuple[Any, ...] | None:
    """The fields of the row's ``kind`` schedule; its id alone if that row is gone."""
    if getattr(row, f"{kind}_id") is None:
        return None
    related = periodic_tasks.related(row, kind)
    if related is None:  # a foreign key SQL bypassed: refused, until the id changes
        return (getattr(row, f"{kind}_id"),)
    return tuple(getattr(related, name) for name in names)
