"""Beat schedules of our own: :class:`cron`, a cron expression as a Celery ``crontab``.

``cron("0 3 * * 1-5", tz="Europe/Berlin")`` goes wherever a Celery schedule
goes (``beat_schedule``, ``app.add_periodic_task``). The expression is parsed
and checked by croniter, so its syntax is cron's own (ranges, steps, lists,
month and weekday names, ``@daily`` and the other aliases); the result is a
Celery ``crontab``, so its slots follow the rules of every crontab beat runs:

* the day fields are ANDed, as in Celery: ``0 0 1 * 1`` fires on a 1st that
  is a Monday, not on every 1st and every Monday as Vixie cron would;
* the expression is read in ``tz`` (a zone name or a ``tzinfo``), else in the
  app's ``timezone``; DST moves and folds are those of
  :mod:`celery_exactonce.core.slots`: a fixed-hour job fires once on both change
  days, a wildcard-hour job at every real instant that matches.

What Celery's crontab cannot say is refused, not approximated: a seconds or a
year field, ``L`` (last day), ``W`` (nearest weekday), ``#`` (nth weekday) and
``H`` (hashed) fields. Every refusal is a
:class:`~celery_exactonce.core.exceptions.ConfigurationError` naming the
expression and the field (``0 0 30 2 *`` names both day fields: 30 February
never comes).

Beat raises it, naming the entry too, when it checks its schedule at start:
``beat entry 'nightly': cron expression '0 3 * * 1-5x': field day_of_week
…``. Building a bad :class:`cron` does not raise: the schedule keeps its
error (:attr:`cron.error`) until beat refuses it or it is used, so a typo in
one beat schedule stops beat with the entry named, never a worker that
imports the same configuration. An expression that fires less than once in
four years (29 February on a Monday) is refused by beat in the same way.

Stock ``celery beat`` runs a :class:`cron` too: it is a ``crontab`` whose
"now" is read in its own zone.

Two more schedules bound others in time; the django-celery-beat scheduler
builds its rows' schedules with them, and they go in ``beat_schedule`` too:

* :class:`at`: one slot, at an instant (django-celery-beat's clocked rows);
* :class:`bounded`: another schedule's slots from ``start`` on, up to
  ``end``, or only the first of them (``first_only``: a one-off row).

Their slots are computed by :mod:`celery_exactonce.core.slots`, like every
schedule's, the same on every node.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone, tzinfo
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from celery.schedules import BaseSchedule, crontab, schedstate
from croniter import CroniterError
from croniter import croniter as _croniter

from celery_exactonce.core import exceptions

__all__ = ["at", "bounded", "cron"]

#: The five fields of a cron expression, in the order they are written, with
#: their names as Celery's ``crontab`` takes them and their ranges.
FIELDS = (
    ("minute", 0, 59),
    ("hour", 0, 23),
    ("day_of_month", 1, 31),
    ("month_of_year", 1, 12),
    ("day_of_week", 0, 6),
)

_ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}

#: Characters croniter accepts in a field that Celery's crontab has no set for.
_UNSUPPORTED = {
    "l": "'L' (last day or weekday of the month)",
    "w": "'W' (nearest weekday)",
    "#": "'#' (nth weekday of the month)",
    "h": "'H' (hashed values)",
}


#: Month and weekday names, which may hold the letters above ("jul", "wed", "thu").
_NAMES = re.compile(r"jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec|sun|mon|tue|wed|thu|fri|sat")


def _error(expr: object, message: str) -> exceptions.ConfigurationError:
    return exceptions.ConfigurationError(f"cron expression {expr!r}: {message}")


def _fields_of(expr: str) -> list[str]:
    text = expr.strip()
    alias = _ALIASES.get(text.lower())
    if alias is not None:
        return alias.split()
    if text.startswith("@"):
        raise _error(expr, f"unknown alias {text!r} (known: {', '.join(sorted(_ALIASES))})")
    fields = text.split()
    if len(fields) != len(FIELDS):
        names = " ".join(name for name, _, _ in FIELDS)
        raise _error(
            expr,
            f"has {len(fields)} field(s); a cron expression has {len(FIELDS)}: {names} "
            "(no seconds or year field: beat's slots are whole minutes)",
        )
    return fields


def _expand(expr: str, fields: list[str]) -> dict[str, set[int]]:
    """Each field's set of values, as Celery's crontab takes them; errors name the field."""
    for (name, low, high), value in zip(FIELDS, fields, strict=True):
        bare = _NAMES.sub("", value.lower())
        for char, what in _UNSUPPORTED.items():
            if char in bare:
                raise _error(expr, f"field {name} ({value!r}): {what} is not supported")
        alone = " ".join(value if other == name else "*" for other, _, _ in FIELDS)
        try:
            _croniter.expand(alone)
        except CroniterError as exc:
            reason = str(exc).rpartition("is not acceptable")[2].strip(" ,") or "invalid"
            raise _error(
                expr, f"field {name} ({value!r}): {reason}; {name} is {low}-{high}"
            ) from exc
    try:
        expanded, nth = _croniter.expand(" ".join(fields))
    except CroniterError as exc:  # pragma: no cover - every field passed alone
        raise _error(expr, str(exc)) from exc
    if nth:  # pragma: no cover - '#' is refused above
        raise _error(expr, "field day_of_week: '#' (nth weekday of the month) is not supported")
    return {
        name: set(range(low, high + 1)) if "*" in values else {int(v) for v in values}
        for (name, low, high), values in zip(FIELDS, expanded, strict=True)
    }


def _zone(tz: str | tzinfo | None, expr: str) -> tzinfo | None:
    if tz is None or isinstance(tz, tzinfo):
        return tz
    if not isinstance(tz, str):
        raise _error(expr, f"tz must be a zone name or a tzinfo, got {type(tz).__name__}")
    try:
        return ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise _error(expr, f"unknown time zone {tz!r}") from exc


class cron(crontab):  # type: ignore[misc]  # celery is untyped; lower case as its schedules
    """A cron expression as a beat schedule.

    A bad expression or zone does not raise here: it is kept in :attr:`error`.
    Beat refuses the entry at start with that error and the entry's name, and
    using the schedule (``is_due``, ``remaining_estimate``) raises it.

    Parameters
    ----------
    expr:
        Five fields, ``minute hour day-of-month month day-of-week``, or an
        alias such as ``@daily``. The day fields are ANDed, as in Celery's
        ``crontab``.
    tz:
        The zone the expression is read in: a name (``"Europe/Berlin"``) or a
        ``tzinfo``. ``None`` reads it in the app's ``timezone``.
    """

    #: Why the expression or the zone is unusable (naming the expression and the
    #: field), or ``None`` for a good one.
    error: exceptions.ConfigurationError | None = None

    def __init__(
        self, expr: str, tz: str | tzinfo | None = None, *, app: Any = None, nowfun: Any = None
    ) -> None:
        self.expr = expr
        self._given_tz = tz
        try:
            if not isinstance(expr, str):
                raise _error(expr, f"must be a string, got {type(expr).__name__}")
            sets, zone = _expand(expr, _fields_of(expr)), _zone(tz, expr)
            if zone is not None:
                nowfun = nowfun or self._now_in_zone
            try:
                super().__init__(**sets, app=app, nowfun=nowfun)
            except ValueError as exc:  # a day of the month no month of the expression has
                raise _error(expr, f"fields day_of_month and month_of_year: {exc}") from exc
        except exceptions.ConfigurationError as exc:
            self.error = exc
            super().__init__(app=app, nowfun=nowfun)  # a well-formed crontab that never runs
            return
        if zone is not None:
            self.tz = zone  # read by the slots, and by Celery's own crontab

    def _usable(self) -> None:
        if self.error is not None:
            raise self.error

    def remaining_estimate(self, last_run_at: datetime) -> Any:
        """Celery's estimate; raises :attr:`error` for a bad expression."""
        self._usable()
        return super().remaining_estimate(last_run_at)

    def _now_in_zone(self) -> datetime:
        return datetime.now(self.tz)

    def is_due(self, last_run_at: datetime) -> Any:
        """Celery's rule, with ``last_run_at`` read in this schedule's zone.

        Raises :attr:`error` for a bad expression.
        """
        self._usable()
        if "tz" in vars(self):
            last_run_at = last_run_at.astimezone(self.tz)
        return super().is_due(last_run_at)

    def _zone_key(self) -> str | tzinfo | None:
        zone = vars(self).get("tz")
        return getattr(zone, "key", zone)

    def __repr__(self) -> str:
        if self.error is not None:
            return f"<cron: {self.expr!r} (invalid)>"
        zone = self._zone_key()
        return f"<cron: {self.expr!r}{f' {zone}' if zone is not None else ''}>"

    def __reduce__(self) -> tuple[type, tuple[str, str | tzinfo | None]]:
        return (self.__class__, (self.expr, self._given_tz if self.error else self._zone_key()))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, cron) and (self.error or other.error):
            return (self.expr, str(self.error)) == (other.expr, str(other.error))
        if isinstance(other, cron):
            return (self.minute, self.hour, self.day_of_month, self.month_of_year) == (
                other.minute,
                other.hour,
                other.day_of_month,
                other.month_of_year,
            ) and (self.day_of_week, self._zone_key()) == (other.day_of_week, other._zone_key())
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal by value, mutable like crontab


def _aware(name: str, value: datetime) -> datetime:
    if not isinstance(value, datetime) or value.tzinfo is None or value.utcoffset() is None:
        raise exceptions.ConfigurationError(
            f"{name} must be a timezone-aware datetime, got {value!r}"
        )
    return value.astimezone(timezone.utc)


_NEVER = 365 * 24 * 3600.0  # seconds stock beat waits before asking a spent schedule again


class at(BaseSchedule):  # type: ignore[misc]  # celery is untyped; lower case as its schedules
    """One slot, at ``instant`` (an aware datetime): a job that runs once, at a set time.

    Beat claims it as any slot: within ``window_lookback`` of it, once across
    all nodes. An instant already further in the past when beat starts is
    skipped and counted, as a missed slot of any schedule is.
    """

    def __init__(self, instant: datetime, *, app: Any = None, nowfun: Any = None) -> None:
        self.instant = _aware("at(instant)", instant)
        super().__init__(nowfun=nowfun, app=app)

    def remaining_estimate(self, last_run_at: datetime | None) -> timedelta:
        now: datetime = self.now()
        return self.instant - now.astimezone(timezone.utc)

    def is_due(self, last_run_at: datetime | None) -> Any:
        """For stock beat: due once the instant has come, unless it ran since."""
        ran = last_run_at is not None and last_run_at.astimezone(timezone.utc) >= self.instant
        remaining = self.remaining_estimate(last_run_at).total_seconds()
        if ran:
            return schedstate(False, _NEVER)
        return schedstate(remaining <= 0, _NEVER if remaining <= 0 else remaining)

    def __repr__(self) -> str:
        return f"<at: {self.instant.isoformat()}>"

    def __reduce__(self) -> tuple[type, tuple[datetime]]:
        return (self.__class__, (self.instant,))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, at):
            return self.instant == other.instant
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


class bounded(BaseSchedule):  # type: ignore[misc]  # celery is untyped
    """The slots of ``schedule`` from ``start`` (included) to ``end`` (included).

    ``first_only``: only the first slot at or after ``start`` (a one-off job);
    ``start`` is then required, so every node agrees on which slot is first.
    ``anchored``: an interval's slots are ``start + k * run_every`` rather than
    counted from the UNIX epoch (a django-celery-beat row's ``start_time`` picks
    the time of day so); ``start`` is then required. Bounds are aware
    datetimes; ``None`` leaves that side open.
    """

    def __init__(
        self,
        schedule: Any,
        *,
        start: datetime | None = None,
        end: datetime | None = None,
        first_only: bool = False,
        anchored: bool = False,
        app: Any = None,
        nowfun: Any = None,
    ) -> None:
        self.schedule = schedule
        self.start = None if start is None else _aware("bounded(start)", start)
        self.end = None if end is None else _aware("bounded(end)", end)
        self.first_only = bool(first_only)
        self.anchored = bool(anchored)
        for flag, on in (("first_only", first_only), ("anchored", anchored)):
            if on and start is None:
                raise exceptions.ConfigurationError(
                    f"bounded({flag}=True) needs a start: every node must agree on the slots"
                )
        super().__init__(nowfun=nowfun, app=app)

    def is_due(self, last_run_at: datetime) -> Any:
        """For stock beat: the inner schedule's answer, inside the bounds."""
        now = self.now().astimezone(timezone.utc)
        if self.start is not None and now < self.start:
            return schedstate(False, (self.start - now).total_seconds())
        if self.end is not None and now > self.end:
            return schedstate(False, _NEVER)
        start = self.start
        spent = (
            self.first_only
            and start is not None
            and last_run_at is not None
            and last_run_at.astimezone(timezone.utc) >= start
        )
        if spent:
            return schedstate(False, _NEVER)
        return self.schedule.is_due(last_run_at)

    def remaining_estimate(self, last_run_at: datetime) -> timedelta:
        return self.schedule.remaining_estimate(last_run_at)  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        parts = [repr(self.schedule)]
        parts += [
            f"{k}={v.isoformat()}" for k, v in (("start", self.start), ("end", self.end)) if v
        ]
        parts += [flag for flag in ("first_only", "anchored") if getattr(self, flag)]
        return f"<bounded: {' '.join(parts)}>"

    def _key(self) -> tuple[Any, ...]:
        return (self.schedule, self.start, self.end, self.first_only, self.anchored)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_bounded, self._key())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, bounded):
            return self._key() == other._key()
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


def _rebuild_bounded(
    schedule: Any,
    start: datetime | None,
    end: datetime | None,
    first_only: bool,
    anchored: bool = False,
) -> bounded:
    return bounded(schedule, start=start, end=end, first_only=first_only, anchored=anchored)
