"""Crontab slots: the instants a Celery ``crontab`` names, with the DST rules.

:mod:`celery_exactonce.core.slots` is the front (it checks the entry and picks the
kind of schedule); this module is the wall-clock search for one kind, the
crontab: which wall days match, which wall times of a day are real instants,
and where a spring-forward gap or a fall-back fold moves or doubles them. The
rules are written out in :mod:`celery_exactonce.core.slots`' docstring. Pure
functions of their arguments: no I/O, no wall clock, no entry names and no
errors of their own (a crontab reaching here has been checked).
"""

from __future__ import annotations

import sys
from bisect import bisect_left, bisect_right
from datetime import date, datetime, time, timedelta, timezone, tzinfo
from typing import Any
from zoneinfo import ZoneInfo

from celery.schedules import crontab

UTC = timezone.utc

#: How far :func:`latest` searches back, and :func:`celery_exactonce.core.slots.next_slot`
#: forward: four years covers every expression that fires at least once per leap
#: cycle (e.g. 29 February); rarer ones (29 February on a Monday) are refused as
#: configuration errors rather than silently never firing.
SEARCH_DAYS = 4 * 366

_ONE_DAY = timedelta(days=1)
_ONE_MINUTE = timedelta(minutes=1)
_MIDNIGHT = time(0, 0)
_LATEST_SPANS = (
    timedelta(hours=2),
    timedelta(days=2),
    timedelta(days=64),
    timedelta(days=SEARCH_DAYS),
)


def zone_of(sched: crontab, tz: tzinfo) -> tzinfo:
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


def between(
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


def latest(sched: crontab, zone: tzinfo, at: datetime) -> datetime | None:
    # Widening windows: a dense expression is settled by the first (cheap) one,
    # a sparse one by a later window with few slots in it.
    for span in _LATEST_SPANS:
        found = between(sched, zone, at - span, at, sys.maxsize)
        if found:
            return found[-1]
    return None
