"""Nominal slots: the fire times of a beat schedule, the same on every node.

A *slot* is an instant at which a schedule fires by definition, independent of
when any node last ran it, so every beat node derives the same
``(entry, fire_time)`` pairs and the store's create-if-absent picks one
dispatcher per slot (docs/design/protocol.md, "Beat"). Everything here is a pure function of
its arguments: no I/O, no wall clock. Instants in are timezone-aware; slots out
are aware UTC datetimes.

Supported schedules:

* ``celery.schedules.schedule``, ``datetime.timedelta`` and int/float seconds:
  ``origin + k * run_every`` for integer ``k``, anchored at a fixed origin (the
  UNIX epoch by default), never at ``last_run_at``. Celery's ``relative`` flag
  is ignored: anchoring already aligns the slots.
* ``celery.schedules.crontab`` with Celery's semantics: the day fields are
  ANDed (croniter ORs them by default), evaluated in the schedule's own zone
  (its ``tz`` attribute, or the timezone of the app it was built with) or else
  the ``tz`` argument. ``nowfun`` does not choose the zone, as in Celery.
* ``celery.schedules.solar``: the events Celery's ``solar`` computes with
  ``ephem``, each searched from the UTC midnight of its own day.
* :class:`~celery_exactonce.schedules.at`: its one instant;
  :class:`~celery_exactonce.schedules.bounded`: its inner schedule's slots
  within its bounds, or the first one at or after its start.

DST, for crontab: a *fixed-hour* job (the hour field is not all 24
hours) fires once on both change days: a wall time inside a spring-forward gap
fires at the first valid instant after the gap (02:30 Europe/Berlin on the last
Sunday of March fires at 03:00 CEST = 01:00 UTC), and several gap times, or a
gap time and the time the gap ends on, merge into that one slot; a wall time
inside a fall-back fold fires at its first occurrence (``fold=0``) only. A
*wildcard-hour* job fires at every real instant whose wall time matches: both
occurrences of a folded wall time fire, and a wall time inside a gap does not
exist, so it does not fire.

This module checks a schedule and picks its kind; the intervals are computed
here, the crontab's wall-clock search is in :mod:`celery_exactonce.core.cron_slots`
and the solar events' search in :mod:`celery_exactonce.core.solar_slots`.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone, tzinfo
from typing import Any

from celery.schedules import crontab, schedule, solar

from celery_exactonce import schedules
from celery_exactonce.core import cron_slots, exceptions, solar_slots
from celery_exactonce.core.cron_slots import SEARCH_DAYS
from celery_exactonce.core.times import UNIX_EPOCH

UTC = timezone.utc

#: Default cap on the slots one call returns: beat asks for bounded windows,
#: so hitting it means a caller bug or a catch-up that must page (see
#: :func:`slots_between`), not a schedule to enumerate in one list.
DEFAULT_LIMIT = 10_000

__all__ = [
    "DEFAULT_LIMIT",
    "SEARCH_DAYS",
    "latest_slot",
    "next_slot",
    "parse_crontab",
    "slots_between",
    "validate_schedule",
]

_SETTING = "beat_schedule"
_CRON_FIELDS = ("minute", "hour", "day_of_week", "day_of_month", "month_of_year")
_ONE_US = timedelta(microseconds=1)
_ONE_DAY = timedelta(days=1)


def _error(entry: str, message: str) -> exceptions.ConfigurationError:
    return exceptions.ConfigurationError(f"beat entry {entry!r}: {message}", setting=_SETTING)


def _require_aware(name: str, value: datetime) -> None:
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} must be timezone-aware, got naive {value.isoformat()}")


# -- intervals -------------------------------------------------------------------------


def _period_us(entry: str, sched: Any) -> int | None:
    """The interval in microseconds, or None when ``sched`` is not an interval."""
    if isinstance(sched, bool):
        return None
    if isinstance(sched, schedule):
        sched = sched.run_every
        if not isinstance(sched, (timedelta, int, float)) or isinstance(sched, bool):
            raise _error(entry, f"schedule has no usable run_every: {sched!r}")
    try:
        if isinstance(sched, (int, float)):
            sched = timedelta(seconds=sched)
    except (OverflowError, ValueError) as exc:
        raise _error(entry, f"interval out of range: {sched!r}") from exc
    if not isinstance(sched, timedelta):
        return None
    period = sched // _ONE_US
    if period <= 0:
        raise _error(entry, f"interval must be positive, got {sched!r}")
    return period


def _interval_slots(
    period: int, start: datetime, end: datetime, origin: datetime, limit: int
) -> list[datetime]:
    origin = origin.astimezone(UTC)
    first = (start - origin) // _ONE_US // period + 1  # smallest k with slot > start
    last = (end - origin) // _ONE_US // period  # largest k with slot <= end
    last = min(last, first + limit - 1)
    return [origin + timedelta(microseconds=k * period) for k in range(first, last + 1)]


def _check_cron_sets(entry: str, sched: crontab) -> None:
    for field in _CRON_FIELDS:
        if not getattr(sched, field, None):
            raise _error(entry, f"crontab field {field} matches nothing: it can never fire")


# -- solar -----------------------------------------------------------------------------


def _require_ephem(entry: str, sched: solar) -> None:
    if getattr(sched, "ephem", None) is None:
        raise _error(entry, "solar schedules need the 'ephem' package (pip install ephem)")


def _solar_slots(
    entry: str, sched: solar, start: datetime, end: datetime, limit: int
) -> list[datetime]:
    _require_ephem(entry, sched)
    return solar_slots.between(sched, start, end, limit)


# -- bounded schedules ------------------------------------------------------------------


def _origin(sched: schedules.bounded, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the interval anchor of ``sched``: its start if ``anchored``."""
    return {**kwargs, "origin": sched.start} if sched.anchored else kwargs


def _first_bounded(sched: schedules.bounded, **kwargs: Any) -> datetime | None:
    """The first slot of the inner schedule at or after ``sched.start``, within its end."""
    assert sched.start is not None  # noqa: S101  (first_only requires a start)
    kwargs = _origin(sched, kwargs)
    first = next_slot(sched.schedule, sched.start - _ONE_US, **kwargs)
    if first is None or (sched.end is not None and first > sched.end):
        return None
    return first


def _bounded_slots(
    sched: schedules.at | schedules.bounded,
    start: datetime,
    end: datetime,
    *,
    limit: int,
    **kwargs: Any,
) -> list[datetime]:
    if isinstance(sched, schedules.at):
        return [sched.instant] if start < sched.instant <= end else []
    if sched.first_only:
        first = _first_bounded(sched, **kwargs)
        return [first] if first is not None and start < first <= end else []
    kwargs = _origin(sched, kwargs)
    if sched.start is not None:
        start = max(start, sched.start - _ONE_US)
    if sched.end is not None:
        end = min(end, sched.end)
    if end <= start:
        return []
    return slots_between(sched.schedule, start, end, limit=limit, **kwargs)


def _latest_bounded(sched: schedules.bounded, at: datetime, **kwargs: Any) -> datetime | None:
    if sched.first_only:
        first = _first_bounded(sched, **kwargs)
        return first if first is not None and first <= at else None
    kwargs = _origin(sched, kwargs)
    latest = latest_slot(sched.schedule, at if sched.end is None else min(at, sched.end), **kwargs)
    if latest is None or (sched.start is not None and latest < sched.start):
        return None
    return latest


# -- public API ------------------------------------------------------------------------


def slots_between(
    sched: Any,
    start: datetime,
    end: datetime,
    *,
    tz: tzinfo,
    origin: datetime = UNIX_EPOCH,
    limit: int = DEFAULT_LIMIT,
    entry: str = "<unnamed>",
) -> list[datetime]:
    """The nominal slots ``s`` of ``sched`` with ``start < s <= end``, ascending.

    The window is half-open on the left so consecutive windows
    ``(a, b], (b, c]`` never yield a slot twice or skip one, and a slot equal
    to a beat node's "last seen" instant is not returned again.

    Parameters
    ----------
    sched:
        A Celery ``schedule``, ``crontab`` or ``solar``, a ``timedelta``, or a
        number of seconds. Intervals may be sub-second (microsecond
        resolution); their slots then carry microseconds.
    start, end:
        Aware instants bounding the window.
    tz:
        The app's time zone (a PEP 495 tzinfo such as ``ZoneInfo``), used by a
        crontab that has no zone of its own.
    origin:
        Aware anchor of interval slots (``origin + k * run_every``). The default, the
        UNIX epoch, is fixed: every node (and every restart) derives the same grid.
    limit:
        At most this many slots are returned: the *earliest* ones. A result of
        exactly ``limit`` slots may be truncated; page on with
        ``start=result[-1]``.
    entry:
        The beat entry's name, for error messages.

    Returns
    -------
    list[datetime]
        Aware UTC instants; second-granular schedules have microsecond 0.

    Raises
    ------
    ConfigurationError
        ``sched`` is of an unsupported type, a non-positive interval, a crontab
        field that matches nothing, or a solar schedule without ``ephem``.
    ValueError
        ``start``, ``end`` or ``origin`` is naive, or ``limit`` < 1.
    """
    for name, value in (("start", start), ("end", end), ("origin", origin)):
        _require_aware(name, value)
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    start, end = start.astimezone(UTC), end.astimezone(UTC)
    if end <= start:
        return []
    if isinstance(sched, (schedules.at, schedules.bounded)):
        return _bounded_slots(sched, start, end, tz=tz, origin=origin, limit=limit, entry=entry)
    period = _period_us(entry, sched)
    if period is not None:
        return _interval_slots(period, start, end, origin, limit)
    if isinstance(sched, crontab):
        _check_cron_sets(entry, sched)
        return cron_slots.between(sched, cron_slots.zone_of(sched, tz), start, end, limit)
    if isinstance(sched, solar):
        return _solar_slots(entry, sched, start, end, limit)
    raise _unsupported(entry, sched)


def latest_slot(
    sched: Any,
    at: datetime,
    *,
    tz: tzinfo,
    origin: datetime = UNIX_EPOCH,
    entry: str = "<unnamed>",
) -> datetime | None:
    """The last nominal slot ``<= at`` (catch-up policy ``latest``), or None.

    A crontab is searched in widening windows (2 hours, 2 days, 64 days, then
    :data:`SEARCH_DAYS` days) before ``at``, so the cost is that of the days
    scanned plus the slots found; a solar schedule is searched for the two days
    before ``at``. Parameters and
    errors are those of :func:`slots_between`.
    """
    _require_aware("at", at)
    _require_aware("origin", origin)
    at = at.astimezone(UTC)
    if isinstance(sched, schedules.at):
        return sched.instant if sched.instant <= at else None
    if isinstance(sched, schedules.bounded):
        return _latest_bounded(sched, at, tz=tz, origin=origin, entry=entry)
    period = _period_us(entry, sched)
    if period is not None:
        origin = origin.astimezone(UTC)
        return origin + timedelta(microseconds=(at - origin) // _ONE_US // period * period)
    if isinstance(sched, crontab):
        _check_cron_sets(entry, sched)
        return cron_slots.latest(sched, cron_slots.zone_of(sched, tz), at)
    if isinstance(sched, solar):
        found = _solar_slots(entry, sched, at - 2 * _ONE_DAY, at, DEFAULT_LIMIT)
        return found[-1] if found else None
    raise _unsupported(entry, sched)


def next_slot(
    sched: Any,
    after: datetime,
    *,
    tz: tzinfo,
    origin: datetime = UNIX_EPOCH,
    entry: str = "<unnamed>",
) -> datetime | None:
    """The first nominal slot ``> after`` within :data:`SEARCH_DAYS` days, or None.

    Beat uses it to know how long it may sleep. Parameters and errors are
    those of :func:`slots_between`.
    """
    found = slots_between(
        sched,
        after,
        after + timedelta(days=SEARCH_DAYS),
        tz=tz,
        origin=origin,
        limit=1,
        entry=entry,
    )
    return found[0] if found else None


def _unsupported(entry: str, sched: Any) -> exceptions.ConfigurationError:
    kind = f"{type(sched).__module__}.{type(sched).__qualname__}"
    return _error(
        entry,
        f"unsupported schedule type {kind}: use a celery crontab, schedule or solar, "
        "a celery_exactonce.schedules cron, at or bounded, a timedelta, or a number of seconds",
    )


def parse_crontab(entry: str, **fields: Any) -> crontab:
    """A Celery ``crontab`` built from ``fields``, errors naming the entry.

    Parameters
    ----------
    entry:
        The beat entry's name, for error messages.
    **fields:
        ``minute``, ``hour``, ``day_of_week``, ``day_of_month``,
        ``month_of_year`` (cron specs as Celery accepts them), and optionally
        ``app`` or ``nowfun``.

    Raises
    ------
    ConfigurationError
        A field is unknown or invalid (Celery's ``ValueError``/``TypeError``),
        or ``day_of_month`` never occurs in ``month_of_year``; the message
        names the entry and the field(s).
    """
    unknown = sorted(set(fields) - {*_CRON_FIELDS, "app", "nowfun"})
    if unknown:
        raise _error(entry, f"unknown crontab field(s) {', '.join(unknown)}")
    try:
        return crontab(**fields)
    except (ValueError, TypeError) as exc:
        culprits = []
        for field in _CRON_FIELDS:
            if field in fields:
                try:
                    crontab(**{field: fields[field]})
                except (ValueError, TypeError):
                    culprits.append(field)
        names = ", ".join(culprits) or "day_of_month, month_of_year"
        raise _error(entry, f"invalid crontab field {names}: {exc}") from exc


def validate_schedule(entry: str, sched: Any, tz: tzinfo, *, at: datetime = UNIX_EPOCH) -> None:
    """Refuse a schedule beat could not compute slots for, naming the entry.

    Checks the type, that a :class:`~celery_exactonce.schedules.cron` parsed,
    that an interval is positive, that no crontab field is
    empty, that a crontab has a slot within :data:`SEARCH_DAYS` days after
    ``at`` (pass the current time at start-up; an expression that fires less
    often than that, e.g. 29 February on a Monday, is refused), and that a
    solar schedule has ``ephem``.

    Raises
    ------
    ConfigurationError
        The schedule is unusable; the message names ``entry`` and the reason.
    """
    if isinstance(sched, schedules.cron) and sched.error is not None:
        raise _error(entry, str(sched.error)) from sched.error
    if isinstance(sched, schedules.at):
        return
    if isinstance(sched, schedules.bounded):
        inner_at = at if sched.start is None else max(at, sched.start)
        validate_schedule(entry, sched.schedule, tz, at=inner_at)
        return
    if _period_us(entry, sched) is not None:
        return
    if isinstance(sched, crontab):
        if next_slot(sched, at, tz=tz, entry=entry) is None:
            raise _error(entry, f"crontab {sched!r} has no slot in {SEARCH_DAYS} days")
        return
    if isinstance(sched, solar):
        _require_ephem(entry, sched)
        return
    raise _unsupported(entry, sched)
