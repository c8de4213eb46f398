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

from celery_exactonce import runtime
from celery_exactonce.beat import stored
from celery_exactonce.beat.checks import check_beat_entry, fixed_names, uses_django_rows
from celery_exactonce.core import exceptions, times
from celery_exactonce.schedules import at
from celery_exactonce.stores.base import StateStore, check_entry_name

__all__ = [
    "StoredEntry",
    "check",
    "delete",
    "get",
    "list_stored",
    "pause",
    "resign",
    "resume",
    "save",
    "save_many",
]

#: What a spec of :func:`save_many` holds when it does not say (``paused``: as stored).
_SPEC_DEFAULTS: dict[str, Any] = {"args": (), "kwargs": None, "options": None, "paused": None}
#: Times a change is tried again when another writer changed the entry under it.
_ATTEMPTS = 5


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
    paused: bool | None = None,
) -> StoredEntry:
    """Store entry ``name`` (replacing one of that name); every beat runs it from its next tick.

    ``schedule`` is seconds or a ``timedelta``, a cron expression (``"*/5 * * * *"``,
    :class:`~celery_exactonce.schedules.cron` for another zone, Celery's
    ``crontab``), an :class:`~celery_exactonce.schedules.at` or Celery's
    ``solar``. ``options`` are ``apply_async``'s (``queue``, ``priority``,
    ``expires`` in seconds...) and ``options["exactonce"]`` the entry's policy,
    as in ``beat_schedule``; everything must be JSON. ``paused``: ``None``
    keeps what is stored (a new entry runs).

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
    scheduler it comes from ran). Each write replaces the definition it was
    built from: one another writer changed meanwhile is built again from the
    new one (a pause made meanwhile stays).
    """
    _refuse_django(app)
    specs = list(specs)
    store = _store(app)
    _, found = store.read_entries()
    now = store.now()
    built = _built(app, specs, found, now)
    saved = []
    for spec, first in zip(specs, built, strict=True):
        entry, text = first
        for _ in range(_ATTEMPTS):
            if store.write_entry(entry.name, text, expect=found.get(entry.name)) is not None:
                break
            _, found = store.read_entries()  # another writer's change: build on it
            entry, text = _build(app, spec, found, now)
        else:
            raise _busy(entry.name)
        saved.append(entry)
    return saved


def check(
    app: Any, specs: Iterable[Mapping[str, Any]]
) -> list[StoredEntry | exceptions.ConfigurationError]:
    """What :func:`save_many` would store for each of ``specs``, checked alone, stored nowhere:
    the entry, or the refusal naming it."""
    _refuse_django(app)
    store = _store(app)
    _, found = store.read_entries()
    now = store.now()
    checked: list[StoredEntry | exceptions.ConfigurationError] = []
    for spec in specs:
        try:
            checked.append(_build(app, spec, found, now)[0])
        except exceptions.ConfigurationError as exc:
            checked.append(exc)
    return checked


def delete(app: Any, name: str) -> bool:
    """Remove stored entry ``name``, whatever it holds (one beat refuses too); whether there
    was one. Beat fires it no more."""
    store = _store(app)
    if check_entry_name(name) not in store.read_entries()[1]:
        return False
    store.write_entry(name, None)
    return True


def pause(app: Any, name: str) -> StoredEntry:
    """Pause stored entry ``name``: no node fires it until :func:`resume`.

    Raises ``KeyError`` naming it when there is no such entry, and the refusal
    of one beat cannot read (:func:`delete` removes that).
    """
    return _set_paused(app, name, True)


def resume(app: Any, name: str) -> StoredEntry:
    """Resume stored entry ``name`` from now (what fell due while paused does not run)."""
    return _set_paused(app, name, False)


def resign(app: Any) -> list[str]:
    """Write every stored entry again as it reads: signed with the first of
    ``exactonce_signing_key``'s keys (after a rotation put a new key first, and before
    the old one is dropped). One that does not verify is left as it is. The names
    written."""
    store = _store(app)
    written = []
    for name, text in sorted(store.read_entries()[1].items()):
        if _parsed(name, text) is not None and store.write_entry(name, text, expect=text):
            written.append(name)
    return written


def get(app: Any, name: str) -> StoredEntry | None:
    """Stored entry ``name``, or ``None``; the refusal of a definition beat cannot read."""
    text = _store(app).read_entries()[1].get(check_entry_name(name))
    return None if text is None else StoredEntry.parse(name, text)


def list_stored(app: Any) -> dict[str, StoredEntry | exceptions.ConfigurationError]:
    """Every stored entry by name; one whose definition beat cannot read (newer, not JSON,
    not signed) as that refusal, naming it. ``exactonce check`` checks the rest as beat does."""
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


def _busy(name: str) -> exceptions.ExactOnceError:
    return exceptions.ExactOnceError(
        f"stored entry {name!r} changed {_ATTEMPTS} times while this change was made: try again"
    )


def _built(
    app: Any, specs: list[Mapping[str, Any]], found: Mapping[str, str], now: datetime
) -> list[tuple[StoredEntry, str]]:
    built = [_build(app, spec, found, now) for spec in specs]
    names = [entry.name for entry, _ in built]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise stored.refused(twice[0], "given twice")
    return built


def _build(
    app: Any, spec: Mapping[str, Any], found: Mapping[str, str], now: datetime
) -> tuple[StoredEntry, str]:
    """The entry of ``spec`` (over what ``found`` holds of it), checked as beat checks it."""
    name = _checked_name(app, spec.get("name"))
    unknown = sorted(set(spec) - {*_SPEC_DEFAULTS, "name", "task", "schedule", "since"})
    if unknown:
        raise stored.refused(name, f"unknown fields {unknown}")
    spec = {**_SPEC_DEFAULTS, **spec}
    kinds = (("args", (list, tuple)), ("kwargs", Mapping), ("options", Mapping))
    for key, kind in kinds:
        if spec[key] is not None and not isinstance(spec[key], kind):
            raise stored.refused(name, f"{key} must be a {_kind(kind)}, got {spec[key]!r}")
    if spec["paused"] is not None and not isinstance(spec["paused"], bool):
        raise stored.refused(name, f"paused must be True or False, got {spec['paused']!r}")
    try:
        sched = stored.encode_schedule(spec.get("schedule"))
    except ValueError as exc:
        raise stored.refused(name, f"schedule: {exc}") from exc
    previous = _parsed(name, found.get(name))
    paused = spec["paused"] if spec["paused"] is not None else bool(previous and previous.paused)
    keep = previous is not None and previous.schedule == sched and not previous.paused
    since = _since(name, spec.get("since")) or (previous.since if previous and keep else now)
    if isinstance(spec["schedule"], at) and spec["schedule"].instant < since:
        raise stored.refused(name, f"its one slot, {spec['schedule'].instant}, is past")
    entry = StoredEntry(
        name=name,
        task=spec.get("task"),  # type: ignore[arg-type]  # checked below, as beat checks it
        schedule=sched,
        args=list(spec["args"] or ()),
        kwargs=dict(spec["kwargs"] or {}),
        options=dict(spec["options"] or {}),
        paused=paused,
        since=since,
    )
    if not isinstance(entry.task, str) or not entry.task:
        raise stored.refused(name, f"task must be a task's name, got {entry.task!r}")
    try:
        text = entry.definition()
    except TypeError as exc:
        raise stored.refused(name, str(exc)) from exc
    fields = stored.entry_fields(name, stored.parse(name, text))
    check_beat_entry(app, runtime.config_for(app), name, fields, node="entries.save")
    return entry, text


def _kind(kind: type | tuple[type, ...]) -> str:
    return "list" if kind == (list, tuple) else "mapping"


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
    check_entry_name(name)
    for _ in range(_ATTEMPTS):
        text = store.read_entries()[1].get(name)
        if text is None:
            raise KeyError(f"no stored entry {name!r}")
        entry = StoredEntry.parse(name, text)
        if entry.paused == paused:
            return entry
        since = entry.since if paused else store.now()
        changed = dataclasses.replace(entry, paused=paused, since=since)
        if store.write_entry(name, changed.definition(), expect=text) is not None:
            return changed
    raise _busy(name)


def _checked_name(app: Any, name: object) -> str:
    try:
        checked = check_entry_name(name)
    except exceptions.InvalidPayload as exc:
        raise exceptions.ConfigurationError(f"stored entry: {exc}", setting="entries") from exc
    if checked in fixed_names(app, runtime.config_for(app)):
        raise stored.refused(
            checked, "beat_schedule (or beat itself) has an entry of this name: pick another"
        )
    return checked


def _refuse_django(app: Any) -> None:
    if uses_django_rows(app):
        raise exceptions.ConfigurationError(
            "beat_scheduler runs django-celery-beat's rows (exactonce-django): add and edit "
            "PeriodicTask rows (the admin) rather than stored entries",
            setting="beat_scheduler",
        )
