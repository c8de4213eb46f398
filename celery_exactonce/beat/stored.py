"""Stored beat entries: their definitions in the store, read as beat entries.

An entry saved with :func:`celery_exactonce.entries.save` lives in the job
store as a definition, a JSON object (:func:`encode`)::

    {"v": 1, "task": "app.tasks.report", "schedule": {"cron": "*/5 * * * *", "tz": null},
     "args": [], "kwargs": {}, "options": {"queue": "reports"},
     "paused": false, "since": 1764460800000000}

``schedule`` is one of ``{"every": SECONDS}``, ``{"cron": EXPR, "tz": ZONE}``,
``{"at": MICROS}`` or ``{"solar": EVENT, "lat": LAT, "lon": LON}``. ``since``
is the store time (integer microseconds) the entry was created, re-timed or
resumed at: its slots start there, so a new entry does not catch up slots
from before it existed, a re-timed one does not fire the new schedule's past
slots, and a resumed one does not fire what fell due while it was paused.
Every node reads the same definition, so every node derives the same slots.

Each tick, beat reads the entries' revision (one small read); when it moved,
it reads the definitions and :class:`StoredEntries` says which entries
changed. A definition beat cannot run is refused alone, naming the entry.

Not here: the public functions that write definitions
(:mod:`celery_exactonce.entries`), the store's side (``entries_revision``,
``read_entries``, ``write_entry`` of :class:`~celery_exactonce.stores.base.StateStore`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any, Protocol

from celery import schedules as celery_schedules

from celery_exactonce.core import exceptions, times
from celery_exactonce.observe import metrics
from celery_exactonce.schedules import at, bounded, cron
from celery_exactonce.stores.base import StateStore

#: The definition format this code writes and reads; a newer one is refused, naming both.
DEFINITION_VERSION = 1
#: The keys of a definition.
FIELDS = ("v", "task", "schedule", "args", "kwargs", "options", "paused", "since")
#: Seconds of store time after which beat reads the stored entries whatever their revision.
FULL_READ_INTERVAL = 300.0
#: The field a store puts in a definition it must not run (a signature that fails).
REFUSED = "refused"


def refused(name: str, message: str) -> exceptions.ConfigurationError:
    """A stored entry beat cannot run, named as an entry is."""
    return exceptions.ConfigurationError(f"stored entry {name!r}: {message}", setting="entries")


# -- schedules as JSON ---------------------------------------------------------------------


def encode_schedule(schedule: object) -> dict[str, Any]:
    """``schedule`` as a definition holds it; ``ValueError`` for one it cannot hold.

    Seconds (a number or a ``timedelta``), a cron expression (a string, a
    :class:`~celery_exactonce.schedules.cron` or Celery's ``crontab``), an
    :class:`~celery_exactonce.schedules.at` or Celery's ``solar``.
    """
    if isinstance(schedule, cron):
        if schedule.error is not None:
            raise ValueError(str(schedule.error))
        zone = schedule._given_tz
        return {"cron": schedule.expr, "tz": None if zone is None else str(zone)}
    if isinstance(schedule, str):
        return encode_schedule(cron(schedule))
    if isinstance(schedule, celery_schedules.crontab):
        fields = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
        expr = " ".join(_cron_field(getattr(schedule, f"_orig_{field}")) for field in fields)
        return encode_schedule(cron(expr))
    if isinstance(schedule, celery_schedules.solar):
        return {"solar": schedule.event, "lat": schedule.lat, "lon": schedule.lon}
    if isinstance(schedule, at):
        return {"at": times.to_micros(schedule.instant)}
    if isinstance(schedule, celery_schedules.schedule):
        schedule = schedule.run_every
    if isinstance(schedule, timedelta):
        schedule = schedule.total_seconds()
    if isinstance(schedule, int | float) and not isinstance(schedule, bool):
        if not 0 < schedule < 10**9:
            raise ValueError(f"an interval must be above 0 seconds, got {schedule}")
        return {"every": float(schedule)}
    raise ValueError(
        f"a stored entry's schedule is seconds, a timedelta, a cron expression, cron(), "
        f"crontab(), at() or solar(); got {type(schedule).__name__}"
    )


def _cron_field(value: object) -> str:
    """A crontab field as cron writes it (``[0, 30]`` as ``0,30``)."""
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value) if isinstance(value, set | frozenset) else value
        return ",".join(str(item) for item in items)
    return str(value)


def decode_schedule(name: str, data: object) -> Any:
    """The schedule object of a definition's ``schedule``; a refusal naming the entry."""
    if not isinstance(data, dict):
        raise refused(name, f"schedule must be a JSON object, got {type(data).__name__}")
    try:
        if "every" in data:
            return timedelta(seconds=float(data["every"]))
        if "cron" in data:
            sched = cron(str(data["cron"]), tz=data.get("tz"))
            if sched.error is not None:
                raise refused(name, str(sched.error))
            return sched
        if "at" in data:
            return at(times.from_micros(int(data["at"])))
        if "solar" in data:
            return celery_schedules.solar(str(data["solar"]), data["lat"], data["lon"])
    except exceptions.ConfigurationError:
        raise
    except Exception as exc:  # a value out of range, a field missing: this entry's
        raise refused(name, f"schedule {data}: {type(exc).__name__}: {exc}") from exc
    raise refused(name, f"schedule {data}: none of every, cron, at or solar")


# -- definitions -------------------------------------------------------------------------


def encode(fields: Mapping[str, Any]) -> str:
    """A definition's text (``fields`` as :data:`FIELDS` name them, ``v`` added).

    Raises ``TypeError`` naming the field whose value JSON cannot hold.
    """
    out: dict[str, Any] = {"v": DEFINITION_VERSION}
    for key in FIELDS[1:]:
        try:
            out[key] = json.loads(json.dumps(fields[key]))  # what reading it back gives
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{key} must hold only what JSON holds: {exc}") from exc
    return json.dumps(out, separators=(",", ":"), sort_keys=True)


def parse(name: str, text: str) -> dict[str, Any]:
    """A definition's fields, checked for their kinds; a refusal naming the entry."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise refused(name, f"its definition is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise refused(name, "its definition is not a JSON object")
    if REFUSED in data:
        raise refused(name, str(data[REFUSED]))
    version = data.get("v")
    if not isinstance(version, int) or version > DEFINITION_VERSION:
        raise refused(
            name,
            f"its definition is of format {version!r}, newer than this process reads "
            f"({DEFINITION_VERSION}): upgrade this node",
        )
    kinds = {"task": str, "args": list, "kwargs": dict, "options": dict, "paused": bool}
    for key, kind in {**kinds, "since": int}.items():
        if not isinstance(data.get(key), kind):
            raise refused(name, f"{key} must be a JSON {kind.__name__}")
    return data


def entry_fields(name: str, data: Mapping[str, Any]) -> dict[str, Any]:
    """The ``beat_schedule`` entry of a parsed definition: its slots from ``since`` on."""
    start = times.from_micros(data["since"])
    return {
        "task": data["task"],
        "schedule": bounded(decode_schedule(name, data["schedule"]), start=start),
        "args": list(data["args"]),
        "kwargs": dict(data["kwargs"]),
        "options": dict(data["options"]),
    }


# -- beat's view ----------------------------------------------------------------------------


class Schedule(Protocol):
    """What :class:`StoredEntries` changes: the scheduler's entries."""

    schedule: dict[str, Any]

    def update_from_dict(self, dict_: dict[str, Any]) -> None: ...

    def drop_entry(self, name: str) -> None: ...


@dataclasses.dataclass
class StoredEntries:
    """The stored entries one beat runs: the revision it read and each entry's definition.

    ``fixed`` are the names of the entries beat has from elsewhere (the
    settings' and its own): a stored entry of such a name is refused.
    """

    store: StateStore
    fixed: frozenset[str] = frozenset()
    revision: int | None = None
    read_at: datetime | None = None
    definitions: dict[str, str] = dataclasses.field(default_factory=dict)
    running: set[str] = dataclasses.field(default_factory=set)

    def start(self, target: Schedule) -> None:
        """At beat's start: the stored entries read, and refused if one has a fixed name.

        Raises :class:`ConfigurationError` naming the entries both have. A store
        error leaves them to the first tick, which refuses such an entry alone.
        """
        try:
            revision, found = self.store.read_entries()
        except exceptions.StoreError:
            return
        if clashes := sorted(set(found) & self.fixed):
            raise exceptions.ConfigurationError(
                f"stored entries {clashes} have the names of beat_schedule entries: rename "
                "one, or remove the stored one (celery -A APP exactonce schedule remove NAME)",
                setting="beat_schedule",
            )
        self._take(target, revision, found, None)

    def tick(self, target: Schedule, now: datetime | None = None) -> None:
        """:meth:`refresh`, a store error said (the schedule stays, the next tick reads)."""
        try:
            self.refresh(target, now)
        except exceptions.StoreError as exc:
            metrics.event(
                "schedule_read_failed",
                f"the stored entries cannot be read: the schedule stays as it was ({exc})",
                level=logging.WARNING,
            )

    def refresh(self, target: Schedule, now: datetime | None = None) -> bool:
        """Apply what changed since the last read; whether anything was read.

        Read when the revision moved, and every :data:`FULL_READ_INTERVAL` of
        store time (``now``) whatever it says: a revision a store lost and
        counted again to the same number hides no change longer than that. A
        revision that went back (the store lost writes) is an error, said. A
        store error raises (``StoreError``) and changes nothing: the next tick
        reads again.
        """
        due = now is not None and (
            self.read_at is None or now - self.read_at >= timedelta(seconds=FULL_READ_INTERVAL)
        )
        if self.store.entries_revision() == self.revision and not due:
            return False
        revision, found = self.store.read_entries()
        self._take(target, revision, found, now)
        return True

    def _take(
        self, target: Schedule, revision: int, found: dict[str, str], now: datetime | None
    ) -> None:
        """The schedule made what ``found`` (read at ``revision``, store time ``now``) says."""
        self.read_at = now
        if self.revision is not None and revision < self.revision:
            metrics.event(
                "stored_entries_lost",
                "the stored entries' revision went back from %d to %d: the store lost writes "
                "to them (a failover to a replica behind, a restart without persistence); "
                "beat runs what it holds now",
                self.revision,
                revision,
                level=logging.ERROR,
                sentry=True,
            )
        for name in sorted(set(self.definitions) - set(found)):
            self._stop(target, name)
        for name, text in sorted(found.items()):
            if self.definitions.get(name) != text:
                self._apply(target, name, text)
        self.definitions, self.revision = dict(found), revision
        metrics.event(
            "schedule_reloaded",
            "stored entries read (revision %d): %d run",
            revision,
            len(self.running),
            why="stored",
            rows=len(self.running),
            revision=revision,
        )

    def _apply(self, target: Schedule, name: str, text: str) -> None:
        try:
            if name in self.fixed:
                raise refused(name, "an entry of beat_schedule (or beat's own) has this name")
            data = parse(name, text)
            if data["paused"]:
                self._stop(target, name)
                return
            target.update_from_dict({name: entry_fields(name, data)})
        except Exception as exc:  # one entry, whatever is wrong with it, not beat
            self._stop(target, name)
            text = (
                str(exc)
                if isinstance(exc, exceptions.ConfigurationError)
                else (f"stored entry {name!r}: {type(exc).__name__}: {exc}")
            )
            metrics.event(
                "entry_refused",
                f"{text}: this entry does not run; the others do",
                level=logging.ERROR,
                sentry=True,
                entry=name,
            )
            return
        self.running.add(name)

    def _stop(self, target: Schedule, name: str) -> None:
        if name in self.running:
            self.running.discard(name)
            target.drop_entry(name)
