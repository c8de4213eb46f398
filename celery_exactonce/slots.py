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

DST, for crontab: a *fixed-hour* job (the hour field is not all 24
hours) fires once on both change days: a wall time inside a spring-forward gap
fires at the first valid instant after the gap (02:30 Europe/Berlin on the last
Sunday of March fires at 03:00 CEST = 01:00 UTC), and several gap times, or a
gap time and the time the gap ends on, merge into that one slot; a wall time
inside a fall-back fold fires at its first occurrence (``fold=0``) only. A
*wildcard-hour* job fires at every real instant whose wall time matches: both
occurrences of a folded wall time fire, and a wall time inside a gap does not
exist, so it does not fire.
"""

from __future__ import annotations

import sys
from bisect import bisect_left, bisect_right
from datetime import date, datetime, time, timedelta, timezone, tzinfo
from typing import Any
from zoneinfo import ZoneInfo

from celery.schedules import crontab, schedule, solar

from celery_exactonce import exceptions
from celery_exactonce.times import UNIX_EPOCH

UTC = timezone.utc

#: Default cap on the slots one call returns: beat asks for bounded windows,
#: so hitting it means a caller bug or a catch-up that must page (see
#: :func:`slots_between`), not a schedule to enumerate in one list.
DEFAULT_LIMIT = 10_000

#: How far :func:`latest_slot` and :func:`validate_schedule` search for a
#: crontab slot: four years covers every expression that fires at least once
#: per leap cycle (e.g. 29 February); rarer ones (29 February on a Monday) are
#: refused as configuration errors rather than silently never firing.
SEARCH_DAYS = 4 * 366

_SETTING = "beat_schedule"
_CRON_FIELDS = ("minute", "hour", "day_of_week", "day_of_month", "month_of_year")
_ONE_US = timedelta(microseconds=1)
_ONE_DAY = timedelta(days=1)
_ONE_MINUTE = timedelta(minutes=1)
_LATEST_SPANS = (
    timedelta(hours=2),
    timedelta(days=2),
    timedelta(days=64),
    timedelta(days=SEARCH_DAYS),
)
_MIDNIGHT = time(0, 0)


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


# -- crontab ---------------------------------------------------------------------------


def _zone_of(sched: crontab, tz: tzinfo) -> tzinfo:
    """The zone a crontab is evaluated in: its own, else the app's ``tz``."""
    own = vars(sched).get("tz")  # set on the instance (django-celery-beat does)
    if own is None and getattr(sched, "_app", None) is not None:
        own = sched.app.timezone
    zone: Any = own if own is not None else tz
    if isinstance(zone, str):
        return ZoneInfo(zone)
    if not isinstance(zone, ZoneInfo) and isinstance(getattr(zone, "zone", None), str):
        return ZoneInfo(zone.zone)  # pytz: localize() semantics; use PEP 495 instead
    return zone  # type: ignore[no-any-return]


def _transition(before: datetime, after: datetime, zone: tzinfo) -> datetime:
    """The first instant in ``(before, after]`` with the offset ``after`` has."""
    target = after.astimezone(zone).utcoffset()
    lo, hi = int(before.timestamp()), int(after.timestamp())  # whole seconds: tzdata's grid
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if datetime.fromtimestamp(mid, zone).utcoffset() == target:
            hi = mid
        else:
            lo = mid
    return datetime.fromtimestamp(hi, UTC)


def _locate(wall: datetime, zone: tzinfo) -> tuple[datetime, datetime, bool]:
    """``(first, last, in_gap)``: the UTC instants a naive wall time names.

    Ordinary: ``first == last``. Fold: the two occurrences. Gap: both are the
    first valid instant after the gap, and ``in_gap`` is True. Both ``first``
    and ``last`` are non-decreasing in ``wall``, which the pruning relies on.
    """
    early = wall.replace(tzinfo=zone, fold=0).astimezone(UTC)
    late = wall.replace(tzinfo=zone, fold=1).astimezone(UTC)
    if early <= late:
        return early, late, False
    # PEP 495 in a gap: fold=0 applies the offset before it (a later instant).
    boundary = _transition(late, early, zone)
    return boundary, boundary, True


def _day_matches(sched: crontab, day: date) -> bool:
    return (
        day.month in sched.month_of_year
        and day.day in sched.day_of_month
        and day.isoweekday() % 7 in sched.day_of_week  # Celery: Sunday is 0
    )


def _day_slots(
    sched: crontab, zone: tzinfo, day: date, lo: datetime, hi: datetime
) -> list[datetime]:
    """The sorted slots in ``(lo, hi]`` whose wall time falls on ``day``."""
    midnight = datetime.combine(day, _MIDNIGHT)
    day_first, _, day_gap = _locate(midnight, zone)
    next_first, next_last, next_gap = _locate(midnight + _ONE_DAY, zone)
    if next_last <= lo or day_first > hi:
        return []  # every instant of this wall day lies outside the window
    hours, minutes = sorted(sched.hour), sorted(sched.minute)
    if not (day_gap or next_gap) and next_first == next_last == day_first + _ONE_DAY:
        # No offset change this day (tzdata never has two that cancel out within
        # one): wall minute-of-day n is day_first + n minutes, so bisect the window.
        first_n = 0 if lo < day_first else (lo - day_first) // _ONE_MINUTE + 1
        last_n = min(24 * 60 - 1, (hi - day_first) // _ONE_MINUTE)
        found: list[datetime] = []
        for hour in hours[bisect_left(hours, first_n // 60) : bisect_right(hours, last_n // 60)]:
            low = bisect_left(minutes, first_n - hour * 60)
            high = bisect_right(minutes, last_n - hour * 60)
            found.extend(day_first + (hour * 60 + m) * _ONE_MINUTE for m in minutes[low:high])
        return found
    # A change day: resolve each wall time (hours out of reach pruned; both bounds
    # of _locate are non-decreasing in the wall time).
    wildcard_hour = len(hours) == 24
    candidates: set[datetime] = set()
    for hour in hours:
        hour_start = midnight + timedelta(hours=hour)
        if _locate(hour_start + timedelta(hours=1), zone)[1] <= lo:
            continue
        if _locate(hour_start, zone)[0] > hi:
            break
        for minute in minutes:
            first, last, in_gap = _locate(hour_start.replace(minute=minute), zone)
            if in_gap and wildcard_hour:
                continue  # that wall time never happens: no slot
            candidates.add(first)
            if wildcard_hour:
                candidates.add(last)  # the second occurrence of a folded hour is real too
    return sorted(s for s in candidates if lo < s <= hi)


def _check_cron_sets(entry: str, sched: crontab) -> None:
    for field in _CRON_FIELDS:
        if not getattr(sched, field, None):
            raise _error(entry, f"crontab field {field} matches nothing: it can never fire")


def _cron_slots(
    sched: crontab, zone: tzinfo, start: datetime, end: datetime, limit: int
) -> list[datetime]:
    day = start.astimezone(zone).date() - _ONE_DAY  # a wall day holds instants of days ±1
    last_day = end.astimezone(zone).date() + _ONE_DAY
    found: list[datetime] = []
    while day <= last_day:
        next_day = day + _ONE_DAY
        if _day_matches(sched, day):
            found.extend(_day_slots(sched, zone, day, start, end))
            if len(found) >= limit:
                # Later wall days only yield instants >= their first one (monotone
                # resolution), so whatever lies below it is final.
                floor = _locate(datetime.combine(next_day, _MIDNIGHT), zone)[0]
                settled = sorted(s for s in set(found) if s < floor)
                if len(settled) >= limit:
                    return settled[:limit]
        day = next_day
    return sorted(set(found))[:limit]


def _latest_cron(sched: crontab, zone: tzinfo, at: datetime) -> datetime | None:
    # Widening windows: a dense expression is settled by the first (cheap) one,
    # a sparse one by a later window with few slots in it.
    for span in _LATEST_SPANS:
        found = _cron_slots(sched, zone, at - span, at, sys.maxsize)
        if found:
            return found[-1]
    return None


# -- solar -----------------------------------------------------------------------------


def _solar_event_after(sched: solar, after: datetime) -> datetime:
    """The first event after ``after`` as Celery's ``solar`` computes it, to the second."""
    naive = after.astimezone(UTC).replace(tzinfo=None)  # ephem reads naive datetimes as UTC
    sched.cal.date = naive
    found = sched._next_event(sched.ephem.Date(naive))
    instant: datetime = found.datetime().replace(tzinfo=UTC)
    return instant.replace(microsecond=0)


def _solar_slots(
    entry: str, sched: solar, start: datetime, end: datetime, limit: int
) -> list[datetime]:
    if getattr(sched, "ephem", None) is None:
        raise _error(entry, "solar schedules need the 'ephem' package (pip install ephem)")
    # Each event is searched from the UTC midnight of its own day (then from just
    # after the previous event of that day), so nodes with different windows run
    # the very same ephem computations and agree to the microsecond.
    day = datetime.combine(start.astimezone(UTC).date(), _MIDNIGHT, tzinfo=UTC)
    found: list[datetime] = []
    while day <= end and len(found) < limit:
        cursor = day
        while True:
            event = _solar_event_after(sched, cursor)
            if event >= day + _ONE_DAY or event <= cursor:
                break
            if start < event <= end:
                found.append(event)
            cursor = event + timedelta(minutes=1)
        day += _ONE_DAY
    return sorted(set(found))[:limit]


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
    period = _period_us(entry, sched)
    if period is not None:
        return _interval_slots(period, start, end, origin, limit)
    if isinstance(sched, crontab):
        _check_cron_sets(entry, sched)
        return _cron_slots(sched, _zone_of(sched, tz), start, end, limit)
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
    period = _period_us(entry, sched)
    if period is not None:
        origin = origin.astimezone(UTC)
        return origin + timedelta(microseconds=(at - origin) // _ONE_US // period * period)
    if isinstance(sched, crontab):
        _check_cron_sets(entry, sched)
        return _latest_cron(sched, _zone_of(sched, tz), at)
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
        "a timedelta, or a number of seconds",
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

    Checks the type, that an interval is positive, that no crontab field is
    empty, that a crontab has a slot within :data:`SEARCH_DAYS` days after
    ``at`` (pass the current time at start-up; an expression that fires less
    often than that, e.g. 29 February on a Monday, is refused), and that a
    solar schedule has ``ephem``.

    Raises
    ------
    ConfigurationError
        The schedule is unusable; the message names ``entry`` and the reason.
    """
    if _period_us(entry, sched) is not None:
        return
    if isinstance(sched, crontab):
        if next_slot(sched, at, tz=tz, entry=entry) is None:
            raise _error(entry, f"crontab {sched!r} has no slot in {SEARCH_DAYS} days")
        return
    if isinstance(sched, solar):
        if getattr(sched, "ephem", None) is None:
            raise _error(entry, "solar schedules need the 'ephem' package (pip install ephem)")
        return
    raise _unsupported(entry, sched)
