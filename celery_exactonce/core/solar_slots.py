"""Solar slots: the events a Celery ``solar`` names, computed as Celery computes them.

:mod:`celery_exactonce.core.slots` is the front (it checks the entry, refuses a
``solar`` without ``ephem``, and picks the kind of schedule); this module is
the search for one kind, the solar: each event is searched with ``ephem``
from the UTC midnight of its own day, then from just after the previous
event of that day, so that every node, whatever its window, runs the very
same computations and finds the same instants. Pure functions of their
arguments: no I/O, no wall clock, no entry names and no errors of their own
(a solar reaching here has ``ephem``). Not here: the crontab's wall-clock
search (:mod:`celery_exactonce.core.cron_slots`), the intervals
(:mod:`celery_exactonce.core.slots`).
"""

from __future__ import annotations

from datetime import datetime, time, timedelta, timezone

from celery.schedules import solar

UTC = timezone.utc

_ONE_DAY = timedelta(days=1)
_MIDNIGHT = time(0, 0)


def event_after(sched: solar, after: datetime) -> datetime:
    """The first event after ``after`` as Celery's ``solar`` computes it, to the second."""
    naive = after.astimezone(UTC).replace(tzinfo=None)  # ephem reads naive datetimes as UTC
    sched.cal.date = naive
    found = sched._next_event(sched.ephem.Date(naive))
    instant: datetime = found.datetime().replace(tzinfo=UTC)
    return instant.replace(microsecond=0)


def between(sched: solar, start: datetime, end: datetime, limit: int) -> list[datetime]:
    """Up to ``limit`` events in ``(start, end]``, in order (aware UTC)."""
    # Each event is searched from the UTC midnight of its own day (then from just
    # after the previous event of that day), so nodes with different windows run
    # the very same ephem computations and agree to the microsecond.
    day = datetime.combine(start.astimezone(UTC).date(), _MIDNIGHT, tzinfo=UTC)
    found: list[datetime] = []
    while day <= end and len(found) < limit:
        cursor = day
        while True:
            event = event_after(sched, cursor)
            if event >= day + _ONE_DAY or event <= cursor:
                break
            if start < event <= end:
                found.append(event)
            cursor = event + timedelta(minutes=1)
        day += _ONE_DAY
    return sorted(set(found))[:limit]
