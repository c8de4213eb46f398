"""Times: aware UTC datetimes, and the integer microseconds stores keep them as.

Times are timezone-aware UTC :class:`~datetime.datetime` values at microsecond
precision; stores keep them as integer microseconds since the UNIX epoch
(:data:`UNIX_EPOCH`). Here are the conversions both ways, and :func:`require_aware`,
which refuses a naive datetime.

Not here: where "now" comes from (:mod:`celery_exactonce.core.clock`, or the
store's own clock), a store epoch's birth time
(:func:`celery_exactonce.core.refs.epoch_born`), schedules and their fire times
(:mod:`celery_exactonce.core.slots`).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from celery_exactonce.core import exceptions

#: The UNIX epoch, timezone-aware: what stored microseconds count from.
UNIX_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def to_micros(value: datetime) -> int:
    """Integer microseconds since the UNIX epoch of an aware datetime."""
    delta = require_aware(value, "time") - UNIX_EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def from_micros(value: int) -> datetime:
    """Inverse of :func:`to_micros`."""
    seconds, micros = divmod(int(value), 1_000_000)
    return datetime.fromtimestamp(seconds, tz=timezone.utc).replace(microsecond=micros)


def to_micros_opt(value: datetime | None) -> int | None:
    return None if value is None else to_micros(value)


def from_micros_opt(value: Any) -> datetime | None:
    return None if value is None or value == "" else from_micros(int(value))


def require_aware(value: datetime, name: str) -> datetime:
    """``value`` in UTC; naive datetimes are refused.

    A naive datetime means different instants on nodes in different time zones.
    """
    if not isinstance(value, datetime):
        raise exceptions.InvalidPayload(f"{name} must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise exceptions.InvalidPayload(f"{name} must be timezone-aware, got naive {value!r}")
    return value.astimezone(timezone.utc)
