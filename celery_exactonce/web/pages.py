"""What each page of the dashboard shows, read through the CLI's data functions.

Each ``*_page`` function takes a :class:`~celery_exactonce.cli.base.Session`
(the app, its settings, its store) and the page's input, and returns the
template's context: plain data, times as ISO-8601 UTC strings (the templates
show them to the second). Bad input raises :class:`BadInput` naming the
culprit (a 400 page); a job that is not there, :class:`NotFound` (a 404).
Nothing here knows the web framework: :mod:`celery_exactonce.web.app` serves
these.

The data is the CLI's: ``jobs`` (:func:`~celery_exactonce.cli.inspect.list_page`,
its filters parsed as the command parses them), ``show``
(:func:`~celery_exactonce.cli.inspect.find_job`, and
:func:`~celery_exactonce.cli.inspect.matching_ids` as ``resolve`` reads them), ``schedule``
(:func:`~celery_exactonce.cli.schedule.schedule_data`) and ``status``
(:func:`~celery_exactonce.cli.inspect.status_data`): so every store shows
the same, through the store contract alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import click

from celery_exactonce.cli import base, inspect
from celery_exactonce.cli.entries import Entry, beat_entries
from celery_exactonce.cli.schedule import schedule_data
from celery_exactonce.core import exceptions, keys, refs, slots
from celery_exactonce.core.skipped_slots import merged
from celery_exactonce.core.states import State
from celery_exactonce.dispatch import messages

#: The query of a page: each parameter's values, in order.
Query = Mapping[str, Sequence[str]]

#: Jobs a page lists unless ``limit`` says otherwise.
DEFAULT_LIMIT = 50
#: Next slots the entries page shows per entry.
NEXT_SLOTS = 3
#: Records of skipped slots the entries page reads (newest first), before merging.
SKIPPED_READ = 400
#: Slots before an entry's last claimed one read for its last outcome, while that one runs.
OUTCOME_LOOKBACK = 5
ONE_US = timedelta(microseconds=1)


class BadInput(Exception):
    """A parameter the page cannot take: ``field`` names it, the message says why."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


class NotFound(Exception):
    """No job (or nothing) where the page looked: a 404 page with the message."""


@dataclasses.dataclass(frozen=True)
class Found:
    """A job id the find box resolved: the page to go to is that job's."""

    task_id: str


# -- input --------------------------------------------------------------------------------


def one(query: Query, name: str) -> str | None:
    """The parameter ``name`` (its last value), ``None`` when absent or blank."""
    values = [v.strip() for v in query.get(name, ())]
    return values[-1] if values and values[-1] else None


def task_id_of(value: str, field: str = "task id") -> str:
    """``value`` as a job id the stores take, or :class:`BadInput` naming ``field``."""
    try:
        refs.validate_identifier(value, "task id", refs.MAX_ID_LENGTH)
    except exceptions.InvalidPayload as exc:
        raise BadInput(field, str(exc)) from None
    return value


def _name(query: Query, field: str) -> str | None:
    value = one(query, field)
    if value is not None:
        try:
            refs.validate_identifier(value, field, refs.MAX_NAME_LENGTH)
        except exceptions.InvalidPayload as exc:
            raise BadInput(field, str(exc)) from None
    return value


def states_of(query: Query) -> list[State]:
    """The ``state`` parameters as states in State order (case-insensitive), as ``jobs --state``."""
    chosen = set()
    for value in query.get("state", ()):
        if not value.strip():
            continue
        try:
            chosen.add(State(value.strip().upper()))
        except ValueError:
            known = ", ".join(s.value for s in State)
            raise BadInput("state", f"{value!r} is not a state (one of {known})") from None
    return [s for s in State if s in chosen]


def _limit(query: Query) -> int:
    value = one(query, "limit")
    if value is None:
        return DEFAULT_LIMIT
    if not value.isdigit() or not 1 <= int(value) <= inspect.MAX_LIMIT:
        raise BadInput("limit", f"{value!r} is not a number of jobs from 1 to {inspect.MAX_LIMIT}")
    return int(value)


# -- jobs ---------------------------------------------------------------------------------


def jobs_page(s: base.Session, query: Query) -> dict[str, Any] | Found:
    """The jobs page: the filtered list, a page at a time, or the job the find box names.

    ``id`` (the find box): an id, or the start of one, goes to that job
    (:class:`Found`); a start of several ids lists them; of none, :class:`NotFound`.
    The filters are ``jobs``'s: ``state`` (repeated), ``task``, ``entry``,
    ``older_than`` (an age: 90, 15m, 2h, 1d), ``limit`` and ``cursor``.
    """
    wanted = one(query, "id")
    if wanted is not None:
        return _find(s, task_id_of(wanted, "id"))
    states = states_of(query)
    task, entry = _name(query, "task"), _name(query, "entry")
    age_text = one(query, "older_than")
    try:
        older_than = 0.0 if age_text is None else base.parse_age(age_text)
    except ValueError as exc:
        raise BadInput("older_than", str(exc)) from None
    cursor_text = one(query, "cursor")
    try:
        cursor = None if cursor_text is None else inspect.parse_cursor(cursor_text)
    except ValueError as exc:
        raise BadInput("cursor", str(exc).replace("this command", "this page")) from None
    limit = _limit(query)
    now = s.store.now()
    try:
        page, more = inspect.list_page(
            s.store,
            states or list(State),
            limit,
            cursor,
            older_than=older_than,
            task=task,
            entry=entry,
        )
    except click.BadParameter as exc:
        raise BadInput("cursor", exc.message) from None
    return {
        "jobs": [base.job_json(job, now) for job in page],
        "next_cursor": more,
        "store_time": base.iso(now),
        "states": [st.value for st in State],
        "filters": {
            "state": [st.value for st in states],
            "task": task or "",
            "entry": entry or "",
            "older_than": age_text or "",
            "limit": limit,
        },
    }


def _find(s: base.Session, task_id: str) -> Found | dict[str, Any]:
    if inspect.find_job(s.store, task_id):
        return Found(task_id)
    ids = inspect.matching_ids(s.store, task_id)
    if len(ids) == 1:
        return Found(ids[0])
    if not ids:
        raise NotFound(f"no job whose id is or starts with {task_id!r}")
    return {"prefix": task_id, "matches": ids, "more": len(ids) >= 4 * inspect.CANDIDATES}


# -- one job ------------------------------------------------------------------------------


def job_page(s: base.Session, task_id: str) -> dict[str, Any]:
    """One job (or two: a submitted job and an occurrence under the same id): every field,
    its idempotency key, its history with reasons, and whether it can be cancelled.

    ``task_id`` may be the start of one id; of several, the page lists them
    (``matches``, as the find box does); of none, :class:`NotFound`.
    """
    task_id = task_id_of(task_id)
    try:
        resolved = _find(s, task_id)
    except NotFound:
        raise NotFound(f"no job {task_id!r} in namespace {s.config.namespace!r}") from None
    if not isinstance(resolved, Found):
        return resolved
    now = s.store.now()
    found = inspect.find_job(s.store, resolved.task_id)
    if not found:  # expired between the two reads
        raise NotFound(f"no job {task_id!r} in namespace {s.config.namespace!r}")
    jobs = []
    for job in found:
        data = base.job_json(job, now, history=True)
        data["idempotency_key"] = messages.job_idempotency_key(job, s.store.namespace)
        data["expires_at"] = base.iso(job.expires_at(s.store.retention))
        data["cancellable"] = job.ref.space is refs.Space.SUBMITTED and job.state in (
            State.PENDING,
            State.SCHEDULED,
        )
        jobs.append(data)
    return {"task_id": resolved.task_id, "jobs": jobs, "store_time": base.iso(now)}


# -- entries ------------------------------------------------------------------------------


def entries_page(s: base.Session) -> dict[str, Any]:
    """Each beat entry (``schedule``'s): next slots, last claimed occurrence and its state,
    its last outcome (:func:`_last_outcome`), whether it is paused (a stored entry), and
    the slots skipped, per reason with their counts (``status``'s records)."""
    data = schedule_data(s, NEXT_SLOTS)
    known = {e.name: e for e in beat_entries(s.app, s.config, s.store)}
    tz = ZoneInfo(data["timezone"])
    for row in data["entries"]:
        row["last_outcome"] = _last_outcome(s, row, known.get(row["entry"]), tz)
    skipped: dict[str, list[dict[str, Any]]] = {}
    for r in merged(s.store.skipped(limit=SKIPPED_READ)):
        skipped.setdefault(r.entry, []).append(
            {
                "where": r.where,
                "count": r.count,
                "first": base.iso(r.first),
                "last": base.iso(r.last),
                "node": r.node,
                "at": base.iso(r.at),
            }
        )
    for row in data["entries"]:
        rows = skipped.pop(row["entry"], [])
        row["skipped"] = rows
        totals: dict[str, int] = {}
        for skip in rows:
            totals[skip["where"]] = totals.get(skip["where"], 0) + skip["count"]
        row["skipped_totals"] = totals
        row.setdefault("paused", False)
    # Skipped slots of entries the app no longer has (renamed, removed): shown all the same.
    data["gone"] = [{"entry": name, "skipped": rows} for name, rows in sorted(skipped.items())]
    return data


def _last_outcome(
    s: base.Session, row: dict[str, Any], known: Entry | None, tz: ZoneInfo
) -> dict[str, Any] | None:
    """The newest of the entry's last few claimed occurrences that ended: its slot, state,
    id and reason (``None``: none of them ended, or none is kept).

    The last claimed one when it ended; otherwise the slots before it, back to
    :data:`OUTCOME_LOOKBACK` of them (one read each), as the schedule gives them.
    """
    fire = None if row["last_claimed"] is None else datetime.fromisoformat(row["last_claimed"])
    for _ in range(OUTCOME_LOOKBACK + 1):
        if fire is None:
            return None
        job = s.store.get(keys.occurrence_ref(s.store.namespace, row["entry"], fire))
        if job is not None and job.state.terminal:
            return {
                "slot": base.iso(fire),
                "state": job.state.value,
                "task_id": job.ref.id,
                "reason": job.reason,
            }
        if known is None or known.entry is None:
            return None
        try:
            fire = slots.latest_slot(known.entry.schedule, fire - ONE_US, tz=tz, entry=row["entry"])
        except exceptions.ConfigurationError:  # beat refuses it: the row says why
            return None
    return None


# -- health -------------------------------------------------------------------------------


def health_page(s: base.Session) -> dict[str, Any]:
    """``status``'s data, and the store's epoch (when its life began) and due backlog.

    Reading the epoch of a store that has none starts one, as a beat node's
    start would: a store that is up keeps every write from then on.
    """
    data = inspect.status_data(s)
    epoch = s.store.epoch()
    backlog = s.store.due_backlog()
    data["epoch"] = epoch
    data["epoch_born"] = base.iso(refs.epoch_born(epoch))
    data["backlog"] = {
        "due": backlog.count,
        "oldest_run_at": base.iso(backlog.oldest),
        "oldest_age": round(backlog.oldest_age, 3),
    }
    return data
