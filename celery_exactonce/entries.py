"""Beat entries saved at run time, in the job store, without Django.

Every ``celery beat -S exactonce`` node on the store runs them beside
``beat_schedule``, from its next tick, with the same guarantee: each slot is
claimed once across the nodes, under a key made of the entry's name and the
slot (RedBeat users write ``RedBeatSchedulerEntry(...).save()``; here)::

    from celery_exactonce import entries

    entries.save(app, "nightly-report", "reports.build", "0 3 * * *", kwargs={"day": "today"})
    entries.pause(app, "nightly-report")
    entries.resume(app, "nightly-report")
    entries.delete(app, "nightly-report")

The rules, which django-celery-beat's rows under ``exactonce-django`` follow too:

* **A new or re-timed entry starts at its save.** Its slots count from the
  store time it was saved at: a new entry does not catch up slots from
  before it existed, and a changed schedule does not fire its own past slots.
  A save that keeps the schedule (new arguments, options) keeps its start.
* **No slot twice.** An entry's slots at or below its watermark (the newest
  slot any node claimed) never fire again, whatever is saved under its name
  later: removed and saved again, it goes on after its last claimed slot.
* **Pause and resume.** A paused entry fires nothing; resumed, it starts at
  the resume (the slots that fell due while it was paused are not caught up).
* **Names.** A stored entry may not have the name of a ``beat_schedule``
  entry: :func:`save` refuses it, and beat refuses to start when one has.
  A renamed entry is a new one (delete the old name).

The same from a shell: ``celery -A APP exactonce schedule add|remove|pause|resume``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

from celery.beat import ScheduleEntry

from celery_exactonce import runtime
from celery_exactonce.beat import stored
from celery_exactonce.beat.entries import check_entry, reading
from celery_exactonce.beat.scheduler import entry_policy, internal_entries
from celery_exactonce.core import exceptions, times
from celery_exactonce.stores.base import StateStore, check_entry_name

__all__ = [
    "StoredEntry",
    "check",
    "delete",
    "get",
    "list_stored",
    "pause",
    "resume",
    "save",
    "save_many",
]

#: What a spec of :func:`save_many` holds when it does not say.
_SPEC_DEFAULTS: dict[str, Any] = {"args": (), "kwargs": None, "options": None, "paused": False}
#: The ``beat_scheduler`` values that run django-celery-beat's rows instead.
_DJANGO_SCHEDULERS = ("exactonce-django", "celery_exactonce.contrib.django_celery_beat")


@dataclasses.dataclass(frozen=True)
class StoredEntry:
    """One stored entry, as saved."""

    name: str
    task: str
    #: The schedule as the definition holds it (``{"cron": ..., "tz": ...}``, ``{"every": s}``...).
    schedule: dict[str, Any]
    args: list[Any]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    paused: bool
    #: When its slots start (its save, re-time or resume), in store time.
    since: datetime

    @classmethod
    def parse(cls, name: str, text: str) -> StoredEntry:
        """The entry of a definition; ``ConfigurationError`` naming it for a bad one."""
        data = stored.parse(name, text)
        fields = {key: data[key] for key in ("task", "schedule", "args", "kwargs", "options")}
        since = times.from_micros(data["since"])
        return cls(name=name, **fields, paused=data["paused"], since=since)

    def definition(self) -> str:
        return stored.encode({**dataclasses.asdict(self), "since": times.to_micros(self.since)})


def save(
    app: Any,
    name: str,
    task: str,
    schedule: Any,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    options: Mapping[str, Any] | None = None,
    paused: bool = False,
) -> StoredEntry:
    """Store entry ``name`` (replacing one of that name); every beat runs it from its next tick.

    ``schedule`` is seconds or a ``timedelta``, a cron expression (``"*/5 * * * *"``,
    :class:`~celery_exactonce.schedules.cron` for another zone, Celery's
    ``crontab``), an :class:`~celery_exactonce.schedules.at` or Celery's
    ``solar``. ``options`` are ``apply_async``'s (``queue``, ``priority``,
    ``expires`` in seconds...) and ``options["exactonce"]`` the entry's policy,
    as in ``beat_schedule``; everything must be JSON.

    Raises :class:`~celery_exactonce.core.exceptions.ConfigurationError` naming
    the entry and what is wrong with it (nothing is stored then), and
    ``StoreError`` when the store cannot be reached.
    """
    fields = {"args": args, "kwargs": kwargs, "options": options, "paused": paused}
    return save_many(app, [{"name": name, "task": task, "schedule": schedule, **fields}])[0]


def save_many(app: Any, specs: Iterable[Mapping[str, Any]]) -> list[StoredEntry]:
    """Store several entries, each ``{"name", "task", "schedule", "args", "kwargs",
    "options", "paused"}`` as :func:`save` takes them; all are checked before any is
    stored (a refusal names the entry, and nothing is stored then).

    A spec may also give ``since`` (an aware datetime): where its slots start,
    instead of the save (an importer starts an entry after the last slot the
    scheduler it comes from ran).
    """
    _refuse_django(app)
    store = _store(app)
    _, found = store.read_entries()
    now = store.now()
    built: dict[str, tuple[StoredEntry, str]] = {}
    for spec in specs:
        entry, text = _build(app, spec, found, now)
        if entry.name in built:
            raise stored.refused(entry.name, "given twice")
        built[entry.name] = (entry, text)
    for name, (_, text) in built.items():
        store.write_entry(name, text)
    return [entry for entry, _ in built.values()]


def check(app: Any, spec: Mapping[str, Any]) -> StoredEntry:
    """The entry :func:`save_many` would store for ``spec``, checked, stored nowhere.

    Raises :class:`~celery_exactonce.core.exceptions.ConfigurationError` naming
    the entry, as :func:`save` does.
    """
    _refuse_django(app)
    store = _store(app)
    _, found = store.read_entries()
    return _build(app, spec, found, store.now())[0]


def _build(
    app: Any, spec: Mapping[str, Any], found: Mapping[str, str], now: datetime
) -> tuple[StoredEntry, str]:
    """The entry of ``spec`` and its definition, checked as beat checks it."""
    name = _checked_name(app, spec.get("name"))
    unknown = sorted(set(spec) - {*_SPEC_DEFAULTS, "name", "task", "schedule", "since"})
    if unknown:
        raise stored.refused(name, f"unknown fields {unknown}")
    spec = {**_SPEC_DEFAULTS, **spec}
    try:
        sched = stored.encode_schedule(spec.get("schedule"))
    except ValueError as exc:
        raise stored.refused(name, f"schedule: {exc}") from exc
    previous = _parsed(name, found.get(name))
    keep = previous is not None and previous.schedule == sched and not previous.paused
    entry = StoredEntry(
        name=name,
        task=spec.get("task"),  # type: ignore[arg-type]  # checked below, as beat checks it
        schedule=sched,
        args=list(spec["args"] or ()),
        kwargs=dict(spec["kwargs"] or {}),
        options=dict(spec["options"] or {}),
        paused=bool(spec["paused"]),
        since=_since(name, spec.get("since"))
        or (previous.since if keep and previous is not None else now),
    )
    if not isinstance(entry.task, str) or not entry.task:
        raise stored.refused(name, f"task must be a task's name, got {entry.task!r}")
    try:
        text = entry.definition()
    except TypeError as exc:
        raise stored.refused(name, str(exc)) from exc
    _check(app, entry)
    return entry, text


def delete(app: Any, name: str) -> bool:
    """Remove stored entry ``name``; whether there was one. Beat fires it no more."""
    store = _store(app)
    if _read(store, check_entry_name(name)) is None:
        return False
    store.write_entry(name, None)
    return True


def pause(app: Any, name: str) -> StoredEntry:
    """Pause stored entry ``name``: no node fires it until :func:`resume`.

    Raises ``KeyError`` naming it when there is no such entry.
    """
    return _set_paused(app, name, True)


def resume(app: Any, name: str) -> StoredEntry:
    """Resume stored entry ``name`` from now (what fell due while paused does not run)."""
    return _set_paused(app, name, False)


def get(app: Any, name: str) -> StoredEntry | None:
    """Stored entry ``name``, or ``None``."""
    return _read(_store(app), check_entry_name(name))


def list_stored(app: Any) -> dict[str, StoredEntry | exceptions.ConfigurationError]:
    """Every stored entry by name; one beat would refuse, as the refusal (naming it)."""
    _, found = _store(app).read_entries()
    listed: dict[str, StoredEntry | exceptions.ConfigurationError] = {}
    for name, text in sorted(found.items()):
        try:
            listed[name] = StoredEntry.parse(name, text)
        except exceptions.ConfigurationError as exc:
            listed[name] = exc
    return listed


# -- internals -------------------------------------------------------------------------------


def _store(app: Any) -> StateStore:
    return runtime.runtime_for(app).store


def _read(store: StateStore, name: str) -> StoredEntry | None:
    _, found = store.read_entries()
    text = found.get(name)
    return None if text is None else StoredEntry.parse(name, text)


def _since(name: str, value: object) -> datetime | None:
    """A spec's ``since`` (an aware datetime), or ``None`` when it gives none."""
    if value is None:
        return None
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise stored.refused(name, f"since must be an aware datetime, got {value!r}")
    return value


def _parsed(name: str, text: str | None) -> StoredEntry | None:
    """The stored entry ``text`` holds; ``None`` for none, or one beat refuses (replaced)."""
    try:
        return None if text is None else StoredEntry.parse(name, text)
    except exceptions.ConfigurationError:
        return None


def _set_paused(app: Any, name: str, paused: bool) -> StoredEntry:
    store = _store(app)
    entry = _read(store, check_entry_name(name))
    if entry is None:
        raise KeyError(f"no stored entry {name!r}")
    if entry.paused == paused:
        return entry
    since = entry.since if paused else store.now()
    changed = dataclasses.replace(entry, paused=paused, since=since)
    store.write_entry(name, changed.definition())
    return changed


def _checked_name(app: Any, name: object) -> str:
    try:
        checked = check_entry_name(name)
    except exceptions.InvalidPayload as exc:
        raise exceptions.ConfigurationError(f"stored entry: {exc}", setting="entries") from exc
    fixed = {*(app.conf.beat_schedule or {}), *internal_entries(runtime.config_for(app))}
    if checked in fixed:
        raise stored.refused(
            checked, "beat_schedule (or beat itself) has an entry of this name: pick another"
        )
    return checked


def _check(app: Any, entry: StoredEntry) -> None:
    """What beat checks of an entry, checked before it is stored (a refusal names it)."""
    config = runtime.config_for(app)
    zone = ZoneInfo(str(app.timezone))
    fields = stored.entry_fields(entry.name, stored.parse(entry.name, entry.definition()))
    with reading(entry.name):
        check_entry(
            entry.name,
            ScheduleEntry(name=entry.name, app=app, **fields),
            lambda name, e: entry_policy(app, config, name, e),
            tz=zone,
            now=datetime.now(tz=zone),
            namespace=config.namespace,
            node="entries.save",
        )


def _refuse_django(app: Any) -> None:
    scheduler = app.conf.beat_scheduler
    name = scheduler if isinstance(scheduler, str) else getattr(scheduler, "__module__", "")
    if any(name.startswith(known) for known in _DJANGO_SCHEDULERS):
        raise exceptions.ConfigurationError(
            "beat_scheduler runs django-celery-beat's rows (exactonce-django): add and edit "
            "PeriodicTask rows (the admin) rather than stored entries",
            setting="beat_scheduler",
        )
