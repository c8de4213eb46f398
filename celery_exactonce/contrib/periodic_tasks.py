"""django-celery-beat's rows as beat entries, and what beat writes back to them.

A ``PeriodicTask`` row becomes the entry a ``beat_schedule`` dict would be
(:func:`entry_of`): its schedule as slots every node computes alike
(:mod:`celery_exactonce.schedules`), its arguments from their JSON, its
publish options. The row's name is the entry's key, so a renamed row is a new
entry. What beat writes back (:func:`record_run`, :func:`disable`) is one
guarded ``UPDATE`` each, with no ``save()``: no signal fires, so a run does not
make every node reload the schedule.

Not here: when to read the rows and how the schedule changes in beat
(:mod:`celery_exactonce.contrib.django_celery_beat`).

Everything here needs Django set up with ``django_celery_beat`` installed; the
models are imported when first used.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

from celery_exactonce.beat.entries import ENTRY_OPTIONS
from celery_exactonce.core import exceptions
from celery_exactonce.schedules import at, bounded, cron

#: The header django-celery-beat adds to every message of a row, kept for the
#: tools that read it.
NAME_HEADER = "periodic_task_name"

_SETTING = "django_celery_beat.PeriodicTask"


def refused(name: str, message: str) -> exceptions.ConfigurationError:
    """A row beat cannot run, named as an entry is."""
    return exceptions.ConfigurationError(f"periodic task {name!r}: {message}", setting=_SETTING)


def aware(value: datetime) -> datetime:
    """A datetime from a row as an aware one (a naive one is in Django's ``TIME_ZONE``)."""
    from django.utils import timezone

    if timezone.is_naive(value):
        made: datetime = timezone.make_aware(value, timezone.get_default_timezone())
        return made
    return value


def stored(value: datetime) -> datetime:
    """An aware datetime as a row stores it (naive, in ``TIME_ZONE``, without ``USE_TZ``)."""
    from django.conf import settings
    from django.utils import timezone

    if settings.USE_TZ:
        return value
    naive: datetime = timezone.make_naive(value, timezone.get_default_timezone())
    return naive


def _json(name: str, field: str, text: str | None, default: str, kind: type) -> Any:
    try:
        value = json.loads(text or default)
    except ValueError as exc:
        raise refused(name, f"{field} is not JSON: {exc}") from exc
    if not isinstance(value, kind):
        raise refused(name, f"{field} must be a JSON {kind.__name__}, got {type(value).__name__}")
    return value


def _crontab_of(name: str, row: Any) -> Any:
    """The row's crontab as a :class:`~celery_exactonce.schedules.cron`, else Celery's own."""
    fields = (row.minute, row.hour, row.day_of_month, row.month_of_year, row.day_of_week)
    sched = cron(" ".join(str(field).strip() for field in fields), tz=row.timezone)
    if sched.error is None:
        return sched
    try:  # Celery's syntax where cron's differs (django-celery-beat checks the fields)
        return row.schedule
    except Exception as exc:  # ParseException too (rows also come from SQL and fixtures)
        raise refused(name, f"crontab: {sched.error}") from exc


def related(row: Any, kind: str) -> Any:
    """The row's ``kind`` schedule row (``interval``, ``crontab``...), or ``None`` if gone."""
    from django.core.exceptions import ObjectDoesNotExist

    try:
        return getattr(row, kind)
    except ObjectDoesNotExist:  # read without select_related, and the id points nowhere
        return None


def _related(name: str, row: Any, kind: str) -> Any:
    """The row's ``kind`` schedule, or a refusal when its id points at no row."""
    found = related(row, kind)
    if found is None:  # the foreign key was bypassed (SQL, a fixture): the schedule is gone
        pk = getattr(row, f"{kind}_id")
        raise refused(name, f"its {kind} schedule (id {pk}) does not exist")
    return found


def schedule_of(row: Any) -> Any:
    """The schedule of a ``PeriodicTask`` row, bounded by its start, expiry and one-off."""
    name = row.name
    if row.interval_id is not None:
        interval = _related(name, row, "interval")
        try:
            inner: Any = timedelta(**{interval.period: interval.every})
        except (TypeError, OverflowError) as exc:
            raise refused(name, f"interval {interval.every} {interval.period}: {exc}") from exc
    elif row.crontab_id is not None:
        inner = _crontab_of(name, _related(name, row, "crontab"))
    elif row.solar_id is not None:
        solar = _related(name, row, "solar")
        try:
            inner = solar.schedule
        except Exception as exc:  # an unknown event, a latitude out of range
            raise refused(name, f"solar {solar.event!r}: {exc}") from exc
    elif row.clocked_id is not None:
        clocked = _related(name, row, "clocked")
        inner = at(aware(clocked.clocked_time))
    else:
        raise refused(name, "has no schedule (interval, crontab, solar or clocked)")
    start = None if row.start_time is None else aware(row.start_time)
    end = None if row.expires is None else aware(row.expires)
    one_off = bool(row.one_off) and not isinstance(inner, at)
    # An interval counts from its start_time, as django-celery-beat runs it (the row
    # carries it: every node derives the same slots); without one, from the epoch.
    anchored = start is not None and isinstance(inner, timedelta)
    if one_off and start is None:
        # The first slot after the row's last change: every node reads the same row.
        start = aware(row.date_changed)
    if start is None and end is None and not one_off:
        return inner
    return bounded(inner, start=start, end=end, first_only=one_off, anchored=anchored)


def entry_of(row: Any, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``beat_schedule`` entry of a ``PeriodicTask`` row.

    ``overrides`` is the ``options["exactonce"]`` of the ``beat_schedule``
    entry the row was written from, if any; the row's own are its ``headers``
    JSON's ``"exactonce"`` object (taken out of the published headers), and
    win over them. ``expire_seconds`` becomes the
    entry's ``deadline`` (seconds after the slot), ``expires`` the message's.

    Raises
    ------
    ConfigurationError
        The row cannot be run (its arguments are not JSON, its crontab does
        not parse, it has no schedule); the message names it.
    """
    name = row.name
    options: dict[str, Any] = {
        key: getattr(row, key)
        for key in ("queue", "exchange", "routing_key", "priority")
        if getattr(row, key) not in (None, "")
    }
    headers = _json(name, "headers", row.headers, "{}", dict)
    declared = headers.pop(ENTRY_OPTIONS, None)  # the row's own overrides: never published
    if declared is not None and not isinstance(declared, dict):
        kind = type(declared).__name__
        raise refused(name, f"headers[{ENTRY_OPTIONS!r}] must be a JSON object, got {kind}")
    options["headers"] = {**headers, NAME_HEADER: name}
    if row.expires is not None:
        options["expires"] = aware(row.expires)
    policy = {**(overrides or {}), **(declared or {})}
    if row.expire_seconds is not None:
        policy.setdefault("deadline", row.expire_seconds)
    if policy:
        options[ENTRY_OPTIONS] = policy
    return {
        "task": row.task,
        "schedule": schedule_of(row),
        "args": _json(name, "args", row.args, "[]", list),
        "kwargs": _json(name, "kwargs", row.kwargs, "{}", dict),
        "options": options,
    }


def check_task(app: Any, name: str, entry: dict[str, Any]) -> None:
    """Refuse row ``name`` (its :func:`entry_of` ``entry``) if beat cannot tell its task's kind.

    Beat tells a gated task from a plain one by importing it; a row whose task
    it does not import must say, and the place a row has for it is its
    ``headers`` JSON (``options`` is ``beat_schedule``'s, which a row lacks).
    """
    task = entry["task"]
    if task in app.tasks or "gated" in entry["options"].get(ENTRY_OPTIONS, {}):
        return
    raise refused(
        name,
        f"task {task!r} is not registered in this beat process, so beat cannot tell "
        "whether the workers gate it. Import the task's module in beat (app.conf.imports "
        f'or include), or declare it in the row\'s headers: {{"{ENTRY_OPTIONS}": '
        '{"gated": true}} for an ExactOnceTask, {"gated": false} for a plain task',
    )


def write_settings_row(name: str, app: Any, fields: dict[str, Any]) -> None:
    """Write the ``beat_schedule`` entry ``name`` into its row, as django-celery-beat does,
    unless the row already holds it.

    A row saved again moves ``date_changed``, where a one-off without a
    ``start_time`` starts, and the change marker, which makes every node read
    the rows again: so a beat start that changes nothing writes nothing, and a
    one-off written from the settings keeps its slot across restarts.

    Raises ``ValueError`` or ``TypeError`` for a schedule no row can hold.
    """
    from django_celery_beat.models import PeriodicTask
    from django_celery_beat.schedulers import ModelEntry

    row = PeriodicTask.objects.filter(name=name).first()
    if row is None or not _holds(row, ModelEntry, **fields):
        ModelEntry.from_entry(name, app=app, **fields)


def _holds(
    row: Any,
    entry_class: Any,
    schedule: Any,
    args: Any = None,
    kwargs: Any = None,
    relative: Any = None,
    options: Any = None,
    **extra: Any,
) -> bool:
    """Whether ``row`` holds what ``ModelEntry.from_entry`` would write, as it writes it.

    Its schedule's row is looked up, never saved: saving one moves the marker.
    """
    from celery.schedules import maybe_schedule
    from kombu.utils.json import dumps

    sched = maybe_schedule(schedule)
    fields: dict[str, Any] = {field: None for _, _, field in entry_class.model_schedules}
    for kind, model, field in entry_class.model_schedules:
        if isinstance(sched, kind):
            fields[field] = model.from_schedule(sched)
            break
    else:
        return False  # from_entry says why
    fields.update(
        extra,
        args=dumps(args or []),  # type: ignore[no-untyped-call]  # as from_entry writes
        kwargs=dumps(kwargs or {}),  # type: ignore[no-untyped-call]
        **entry_class._unpack_options(**(options or {})),
    )
    return all(getattr(row, key) == value for key, value in fields.items())


def is_one_off(row: Any) -> bool:
    """Whether the row runs once: ``one_off``, or a clocked schedule."""
    return bool(row.one_off) or row.clocked_id is not None


def enabled_rows() -> list[Any]:
    """Every enabled ``PeriodicTask`` row, with its schedule's row."""
    from django_celery_beat.models import PeriodicTask

    rows = PeriodicTask.objects
    return list(rows.filter(enabled=True).select_related("interval", "crontab", "solar", "clocked"))


def last_change() -> datetime | None:
    """django-celery-beat's change marker: when a row was last saved or deleted."""
    from django_celery_beat.models import PeriodicTasks

    changes = PeriodicTasks.objects
    found = changes.filter(ident=1).values_list("last_update", flat=True).first()
    return None if found is None else aware(found)


def record_run(pk: int, fire: datetime, *, won: bool) -> bool:
    """Count one run of row ``pk`` at slot ``fire``, unless a run at or after it is counted.

    Every node that decided the slot calls this: the one that won its claim
    (``won``), and any that found it claimed, so that a winner killed before
    its call is counted all the same. The guard makes the count grow once per
    slot, whichever comes first. A row whose ``last_run_at`` is empty was
    either never counted (``total_run_count`` 0: any node counts it) or
    disabled since (django-celery-beat empties the field on every save of a
    disabled row): that one is counted by the winner alone, since a slot
    counted before the field was emptied cannot be told from a new one.
    Without ``USE_TZ``, the row stores naive local times, which go back in
    the hour a fall-back repeats: there the guard cannot tell a new slot from
    a counted one, so a slot of that second hour is counted by its winner
    alone, unguarded (a winner killed before its count leaves it uncounted).
    Whether this call counted it.
    """
    from django.db.models import F, Q
    from django_celery_beat.models import PeriodicTask

    when = stored(fire)
    never_counted = Q(last_run_at__isnull=True, total_run_count=0)
    after = Q(last_run_at__lt=when) | (Q(last_run_at__isnull=True) if won else never_counted)
    if aware(when) != fire:  # the repeated hour: its stored time reads as the first one
        if not won:
            return False
        after = Q()
    return bool(
        PeriodicTask.objects.filter(after, pk=pk).update(
            last_run_at=when, total_run_count=F("total_run_count") + 1
        )
    )


def disable(pk: int) -> bool:
    """Disable row ``pk`` (a one-off that ran), once; the other nodes are told to reload.

    Whether this call disabled it.
    """
    from django_celery_beat.models import PeriodicTask, PeriodicTasks

    rows = PeriodicTask.objects
    if not rows.filter(pk=pk, enabled=True).update(enabled=False):
        return False
    PeriodicTasks.update_changed()
    return True
