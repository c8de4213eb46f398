"""The beat entries the CLI shows: ``beat_schedule``, stored ones, beat's own, django's rows.

:func:`beat_entries` gives each entry beat would run, by name, as a
``celery.beat.ScheduleEntry`` (or the error that refuses it); :func:`last_occurrence`
reads the job of an entry's watermark, the last slot any node claimed.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any

from celery import beat

from celery_exactonce.beat import stored
from celery_exactonce.beat.checks import fixed_names, uses_django_rows
from celery_exactonce.beat.scheduler import internal_entries
from celery_exactonce.config import ExactOnceConfig
from celery_exactonce.core import exceptions, keys
from celery_exactonce.core.jobs import Job
from celery_exactonce.stores.base import StateStore


@dataclasses.dataclass
class Entry:
    """One beat entry as the CLI shows it; ``error`` when beat would refuse it."""

    name: str
    entry: Any | None
    source: str
    """``settings`` (``beat_schedule``), ``stored`` (:mod:`celery_exactonce.entries`),
    ``beat`` (beat's own) or ``row`` (django-celery-beat)."""
    error: str | None = None
    #: A stored entry paused: beat does not run it until it is resumed.
    paused: bool = False

    @property
    def task(self) -> str | None:
        return None if self.entry is None else str(self.entry.task)


def _entry(app: Any, name: str, fields: dict[str, Any], source: str) -> Entry:
    try:
        return Entry(name, beat.ScheduleEntry(**dict(fields, name=name, app=app)), source)
    except Exception as exc:  # beat would refuse it: show why, keep the others
        return Entry(name, None, source, f"{type(exc).__name__}: {exc}")


def beat_entries(app: Any, config: ExactOnceConfig, store: StateStore | None = None) -> list[Entry]:
    """Every entry beat would run for ``app``, beat's own last.

    With ``beat_scheduler = "exactonce-django"``: each enabled ``PeriodicTask``
    row (a row beat refuses shows its error), and the ``beat_schedule``
    entries no row holds. Otherwise, given the ``store``, the stored entries
    too (paused ones marked, one beat refuses with its error).
    """
    settings = dict(app.conf.beat_schedule or {})
    found: list[Entry] = []
    if uses_django_rows(app):
        from celery_exactonce.contrib import periodic_tasks

        for row in periodic_tasks.enabled_rows():
            try:
                fields = periodic_tasks.entry_of(row)
            except exceptions.ConfigurationError as exc:
                found.append(Entry(row.name, None, "row", str(exc)))
                continue
            found.append(_entry(app, row.name, fields, "row"))
            settings.pop(row.name, None)
    found.extend(_entry(app, name, fields, "settings") for name, fields in settings.items())
    if store is not None and not uses_django_rows(app):
        found.extend(_stored(app, store, fixed_names(app, config)))
    found.extend(_entry(app, n, f, "beat") for n, f in internal_entries(config).items())
    return found


def _stored(app: Any, store: StateStore, fixed: frozenset[str]) -> list[Entry]:
    _, definitions = store.read_entries()
    found = []
    for name, text in sorted(definitions.items()):
        try:
            data = stored.parse(name, text)
            if name in fixed:
                raise stored.refused(name, "beat_schedule (or beat itself) has this name")
            made = _entry(app, name, stored.entry_fields(name, data), "stored")
        except exceptions.ConfigurationError as exc:
            found.append(Entry(name, None, "stored", str(exc)))
            continue
        made.paused = bool(data["paused"])
        found.append(made)
    return found


def with_last(
    store: StateStore, known: list[Entry]
) -> list[tuple[Entry, datetime | None, Job | None]]:
    """Each of ``known`` with its watermark (its last slot claimed) and that slot's job."""
    marks = store.watermarks([e.name for e in known])
    found = []
    for e in known:
        mark = marks.get(e.name)
        found.append((e, mark, last_occurrence(store, e.name, mark)))
    return found


def last_occurrence(store: StateStore, entry: str, fire: datetime | None) -> Job | None:
    """The job of ``entry``'s slot at ``fire`` (its watermark), if it is still kept."""
    if fire is None:
        return None
    return store.get(keys.occurrence_ref(store.namespace, entry, fire))
