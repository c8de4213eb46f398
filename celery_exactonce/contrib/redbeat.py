"""RedBeat's entries read as stored entries: what ``exactonce import redbeat`` moves over.

RedBeat keeps each entry in a hash ``<prefix><name>`` (``redbeat_key_prefix``,
``"redbeat:"`` by default): ``definition``, a JSON object (name, task, args,
kwargs, options, enabled, and a schedule tagged ``__type__``: ``interval`` or
``crontab``), and ``meta`` (``last_run_at``, ``total_run_count``), its
datetimes tagged too. Entries from RedBeat's ``beat_schedule`` are listed in
``<prefix>:statics``; the ones saved at run time are not.

:func:`read` finds every entry (enabled or not) with ``SCAN``, and
:func:`plan` says, for each, the stored entry it becomes or why it cannot:

* the schedule: an interval becomes one of its seconds (our intervals are
  slots counted from the UNIX epoch, not from the last run), a crontab the
  same cron expression; RedBeat's ``rrule`` has no equal and is not imported;
* a disabled entry is stored paused;
* the slots start just after its ``last_run_at``, so the slot RedBeat ran
  last never runs again; one never run starts at the import;
* a static entry whose name ``beat_schedule`` still has runs from there, and
  is left out; so is one ``beat_schedule`` no longer has (RedBeat would delete
  it at its next start), but for Celery's own ``celery.backend_cleanup``,
  which Celery's scheduler installs and ours does not.

Nothing here writes: the command saves the plan (:func:`celery_exactonce.entries.save_many`)
unless ``--dry-run``. Reads with redis-py only; RedBeat need not be installed.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

from celery.schedules import crontab

#: RedBeat's default key prefix (``redbeat_key_prefix``).
DEFAULT_PREFIX = "redbeat:"
#: Entries Celery's scheduler installs by itself (RedBeat saves them, as statics); ours
#: does not, so they are imported.
CELERY_ENTRIES = frozenset({"celery.backend_cleanup"})
#: The keys under the prefix that are RedBeat's own, not entries.
_OWN = (":schedule", ":statics", ":lock")


@dataclasses.dataclass(frozen=True)
class Found:
    """One RedBeat entry as its hash holds it (decoded), or why it cannot be read."""

    key: str
    name: str
    definition: dict[str, Any] | None
    last_run_at: datetime | None
    total_run_count: int
    static: bool
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class Planned:
    """What one RedBeat entry becomes: a :func:`~celery_exactonce.entries.save_many` spec,
    or ``None`` with the reason it is left out."""

    found: Found
    spec: dict[str, Any] | None
    why_not: str | None = None


def _decode(value: Any) -> Any:
    """RedBeat's tagged JSON values (``__type__``) as plain ones, a schedule as a dict."""
    if isinstance(value, list):
        return [_decode(item) for item in value]
    if not isinstance(value, dict):
        return value
    decoded = {key: _decode(item) for key, item in value.items()}
    kind = decoded.pop("__type__", None)
    if kind == "datetime":
        zone = decoded.pop("timezone", "UTC")
        tz = (
            timezone(timedelta(seconds=float(zone)))
            if isinstance(zone, int | float)
            else ZoneInfo(str(zone))
        )
        return datetime(tzinfo=tz, **decoded)
    if kind is not None:
        return {"__type__": kind, **decoded}
    return decoded


def read(client: Any, prefix: str = DEFAULT_PREFIX) -> Iterator[Found]:
    """Every RedBeat entry under ``prefix`` on ``client`` (a redis-py client), by key."""
    statics = {_text(name) for name in client.smembers(prefix + ":statics")}
    keys = sorted(_text(key) for key in client.scan_iter(match=_glob(prefix) + "*", count=500))
    for key in keys:
        if any(key == prefix + own for own in _OWN) or client.type(key) not in (b"hash", "hash"):
            continue
        definition, meta = client.hmget(key, ["definition", "meta"])
        if definition is None:
            continue
        name = key[len(prefix) :]
        try:
            decoded = _decode(json.loads(_text(definition)))
            got = _decode(json.loads(_text(meta))) if meta else {}
            if not isinstance(decoded, dict) or not isinstance(got, dict):
                raise ValueError("not a JSON object")
            last = got.get("last_run_at")
            count = int(got.get("total_run_count") or 0)
        except Exception as exc:  # any value RedBeat would not have written: this entry's
            yield Found(key, name, None, None, 0, name in statics, f"unreadable: {exc}")
            continue
        yield Found(
            key,
            str(decoded.get("name") or name),
            decoded,
            last if isinstance(last, datetime) else None,
            count,
            name in statics,
        )


def plan(found: Found, settings: Mapping[str, Any], now: datetime) -> Planned:
    """The stored entry ``found`` becomes (``settings``: the app's ``beat_schedule``)."""
    if found.definition is None:
        return Planned(found, None, found.error)
    if found.static and found.name in settings:
        return Planned(found, None, "static: beat_schedule has it, and runs it")
    if found.static and found.name not in CELERY_ENTRIES:
        why = "static, and no longer in beat_schedule (RedBeat removes it at its next start)"
        return Planned(found, None, why)
    d = found.definition
    schedule = d.get("schedule")
    if not isinstance(schedule, dict):
        return Planned(found, None, f"schedule {schedule!r} is not one RedBeat writes")
    kind = schedule.get("__type__")
    when: object
    if kind == "interval":
        when = float(schedule["every"])
    elif kind == "crontab":
        fields = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
        when = crontab(**{field: schedule.get(field, "*") for field in fields})
    else:
        return Planned(found, None, f"a {kind} schedule has no equal here (cron or interval)")
    last = found.last_run_at
    since = now if last is None else last.astimezone(timezone.utc) + timedelta(microseconds=1)
    spec = {
        "name": found.name,
        "task": d.get("task"),
        "schedule": when,
        "args": list(d.get("args") or ()),
        "kwargs": dict(d.get("kwargs") or {}),
        "options": dict(d.get("options") or {}),
        "paused": not d.get("enabled", True),
        "since": since,
    }
    return Planned(found, spec)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _glob(text: str) -> str:
    """``text`` with the characters a ``MATCH`` pattern reads as more than themselves escaped."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
