"""django-celery-beat rows as beat entries, and what beat writes back to them."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery.schedules import solar

from celery_exactonce.contrib import periodic_tasks
from celery_exactonce.core import exceptions, slots
from celery_exactonce.schedules import at, bounded, cron
from tests.django_tests.conftest import ALIASES

UTC = timezone.utc


def _utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]


def _row(name: str = "report", **fields: Any) -> Any:
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    if not {"interval", "crontab", "solar", "clocked"} & set(fields):
        fields["interval"] = IntervalSchedule.objects.create(every=10, period="seconds")
    row = PeriodicTask.objects.create(name=name, task=fields.pop("task", "plain.t"), **fields)
    return PeriodicTask.objects.select_related("interval", "crontab", "solar", "clocked").get(
        pk=row.pk
    )


def test_an_interval_row_is_an_entry_with_its_arguments_and_options(alias: str) -> None:
    row = _row(
        args=json.dumps([1, "two"]),
        kwargs=json.dumps({"three": 3}),
        queue="reports",
        exchange="ex",
        routing_key="rk",
        priority=5,
        headers=json.dumps({"team": "ops"}),
        expire_seconds=30,
    )
    entry = periodic_tasks.entry_of(row)
    assert entry == {
        "task": "plain.t",
        "schedule": timedelta(seconds=10),
        "args": [1, "two"],
        "kwargs": {"three": 3},
        "options": {
            "queue": "reports",
            "exchange": "ex",
            "routing_key": "rk",
            "priority": 5,
            "headers": {"team": "ops", "periodic_task_name": "report"},
            "exactonce": {"deadline": 30},
        },
    }


def test_a_crontab_row_is_a_cron_in_its_zone(alias: str) -> None:
    from django_celery_beat.models import CrontabSchedule

    tab = CrontabSchedule.objects.create(
        minute="0", hour="3", day_of_week="mon-fri", timezone=ZoneInfo("Europe/Berlin")
    )
    sched = periodic_tasks.schedule_of(_row(crontab=tab))
    assert sched == cron("0 3 * * mon-fri", tz="Europe/Berlin")
    assert slots.next_slot(sched, _utc(2026, 3, 27), tz=UTC) == _utc(2026, 3, 27, 2)  # CET


def test_a_crontab_row_cron_cannot_read_runs_as_celerys_crontab(alias: str) -> None:
    from django_celery_beat.models import CrontabSchedule

    # Celery's parser takes what croniter's does not, e.g. weekdays' full names
    tab = CrontabSchedule.objects.create(
        minute="0", hour="9", day_of_week="monday-friday", timezone=ZoneInfo("UTC")
    )
    sched = periodic_tasks.schedule_of(_row(crontab=tab))
    assert not isinstance(sched, cron)
    assert sched.day_of_week == {1, 2, 3, 4, 5}
    assert slots.next_slot(sched, _utc(2026, 5, 2), tz=UTC) == _utc(2026, 5, 4, 9)  # a Monday


def test_a_clocked_row_is_one_slot_and_a_one_off_its_first_slot(alias: str) -> None:
    from django_celery_beat.models import ClockedSchedule, IntervalSchedule

    clocked = ClockedSchedule.objects.create(clocked_time=_utc(2026, 5, 1, 12))
    assert periodic_tasks.schedule_of(_row("clock", clocked=clocked, one_off=True)) == at(
        _utc(2026, 5, 1, 12)
    )
    hourly = IntervalSchedule.objects.create(every=1, period="hours")
    start = _utc(2026, 5, 1, 9, 30)
    one_off = _row("once", interval=hourly, one_off=True, start_time=start)
    sched = periodic_tasks.schedule_of(one_off)
    assert sched == bounded(timedelta(hours=1), start=start, first_only=True, anchored=True)
    assert slots.slots_between(sched, _utc(2026, 5, 1), _utc(2026, 5, 2), tz=UTC) == [start]
    # Without a start time, the first slot after the row's last change
    anchored = periodic_tasks.schedule_of(_row("anchored", interval=hourly, one_off=True))
    assert isinstance(anchored, bounded)
    assert anchored.start == periodic_tasks.aware(anchored_row_changed("anchored"))


def anchored_row_changed(name: str) -> datetime:
    from django_celery_beat.models import PeriodicTask

    return PeriodicTask.objects.get(name=name).date_changed  # type: ignore[no-any-return]


def test_start_time_and_expires_bound_the_slots(alias: str) -> None:
    row = _row(start_time=_utc(2026, 5, 1, 0, 0, 5), expires=_utc(2026, 5, 1, 0, 0, 40))
    entry = periodic_tasks.entry_of(row)
    assert entry["options"]["expires"] == _utc(2026, 5, 1, 0, 0, 40)
    fires = slots.slots_between(entry["schedule"], _utc(2026, 5, 1), _utc(2026, 5, 2), tz=UTC)
    assert fires == [_utc(2026, 5, 1, 0, 0, s) for s in (5, 15, 25, 35)]


def test_an_interval_row_with_a_start_time_runs_at_start_time_plus_whole_intervals(
    alias: str,
) -> None:
    """A daily row whose ``start_time`` is 09:30 runs at 09:30 every day, as django-celery-beat
    runs it. Before the fix its slots were counted from the UNIX epoch: midnight UTC."""
    from django_celery_beat.models import IntervalSchedule

    daily = IntervalSchedule.objects.create(every=1, period="days")
    start = _utc(2026, 5, 1, 9, 30)
    sched = periodic_tasks.schedule_of(_row(interval=daily, start_time=start))
    fires = slots.slots_between(sched, _utc(2026, 4, 20), _utc(2026, 5, 4), tz=UTC)
    assert fires == [_utc(2026, 5, d, 9, 30) for d in (1, 2, 3)]
    assert slots.latest_slot(sched, _utc(2026, 5, 3, 9), tz=UTC) == _utc(2026, 5, 2, 9, 30)
    assert slots.next_slot(sched, _utc(2026, 5, 3, 9), tz=UTC) == _utc(2026, 5, 3, 9, 30)
    # Without a start_time, an interval keeps the epoch's grid
    plain = periodic_tasks.schedule_of(_row("plain", interval=daily))
    assert slots.next_slot(plain, _utc(2026, 5, 3, 9), tz=UTC) == _utc(2026, 5, 4)


def test_a_solar_row_is_celerys_solar(alias: str) -> None:
    pytest.importorskip("ephem")
    from django_celery_beat.models import SolarSchedule

    sun = SolarSchedule.objects.create(event="sunrise", latitude=52.52, longitude=13.405)
    sched = periodic_tasks.schedule_of(_row(solar=sun))
    assert isinstance(sched, solar)
    assert sched.event == "sunrise"


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"args": "[1, "}, "periodic task 'report': args is not JSON"),
        ({"kwargs": "[1]"}, "periodic task 'report': kwargs must be a JSON dict, got list"),
        ({"headers": "{oops"}, "periodic task 'report': headers is not JSON"),
    ],
)
def test_a_row_beat_cannot_run_is_refused_naming_it(
    alias: str, fields: dict[str, str], words: str
) -> None:
    with pytest.raises(exceptions.ConfigurationError) as caught:
        periodic_tasks.entry_of(_row(**fields))
    assert words in str(caught.value)


def test_a_bad_crontab_row_names_the_row_and_the_field(alias: str) -> None:
    from django_celery_beat.models import CrontabSchedule

    tab = CrontabSchedule.objects.create(minute="0", hour="25", timezone=ZoneInfo("UTC"))
    with pytest.raises(exceptions.ConfigurationError) as caught:
        periodic_tasks.schedule_of(_row(crontab=tab))
    assert "periodic task 'report': crontab: cron expression '0 25 * * *': field hour" in str(
        caught.value
    )


def test_a_run_is_counted_once_per_slot_whoever_records_it(alias: str) -> None:
    from django_celery_beat.models import PeriodicTask

    row = _row()
    first, second = _utc(2026, 5, 1, 0, 0, 10), _utc(2026, 5, 1, 0, 0, 20)
    assert periodic_tasks.record_run(row.pk, first, won=True) is True
    assert periodic_tasks.record_run(row.pk, first, won=False) is False  # a second node, same slot
    assert periodic_tasks.record_run(row.pk, first, won=True) is False  # the winner again
    assert periodic_tasks.record_run(row.pk, second, won=False) is True  # a killed winner's slot
    assert periodic_tasks.record_run(row.pk, first, won=False) is False  # late and out of order
    counted = PeriodicTask.objects.get(pk=row.pk)
    assert (counted.total_run_count, counted.last_run_at) == (2, second)


def test_a_never_run_rows_first_slot_is_counted_by_a_node_that_found_it_claimed(
    alias: str,
) -> None:
    # A one-off (or a new row) whose winner was SIGKILLed between its publish and its
    # count: the other node, which found the slot claimed, counts it, and only once
    from django_celery_beat.models import PeriodicTask

    row = _row()
    slot = _utc(2026, 5, 1, 0, 0, 10)
    assert periodic_tasks.record_run(row.pk, slot, won=False) is True
    assert periodic_tasks.record_run(row.pk, slot, won=False) is False  # a third node
    assert periodic_tasks.record_run(row.pk, slot, won=True) is False  # the winner, had it lived
    counted = PeriodicTask.objects.get(pk=row.pk)
    assert (counted.total_run_count, counted.last_run_at) == (1, slot)


def test_a_disabled_row_emptied_by_its_save_is_not_counted_again_by_a_late_node(
    alias: str,
) -> None:
    # django-celery-beat empties last_run_at whenever a disabled row is saved: a node
    # that finds the slot claimed afterwards must not count it a second time
    from django_celery_beat.models import PeriodicTask

    row = _row()
    slot = _utc(2026, 5, 1, 0, 0, 10)
    assert periodic_tasks.record_run(row.pk, slot, won=True) is True
    row = PeriodicTask.objects.get(pk=row.pk)
    row.enabled = False
    row.save()
    assert PeriodicTask.objects.get(pk=row.pk).last_run_at is None
    assert periodic_tasks.record_run(row.pk, slot, won=False) is False
    assert PeriodicTask.objects.get(pk=row.pk).total_run_count == 1


def test_disabling_a_one_off_happens_once_and_moves_the_marker(alias: str) -> None:
    from django_celery_beat.models import PeriodicTask

    row = _row(one_off=True, start_time=_utc(2026, 5, 1))
    before = periodic_tasks.last_change()
    assert periodic_tasks.disable(row.pk) is True
    assert periodic_tasks.disable(row.pk) is False
    assert PeriodicTask.objects.get(pk=row.pk).enabled is False
    assert periodic_tasks.last_change() not in (None, before)
    assert [r.name for r in periodic_tasks.enabled_rows()] == []


# USE_TZ is switched for SQLite only: a server connection keeps the zone it opened with.
@pytest.mark.parametrize("alias", ALIASES[:1], indirect=True)
def test_record_run_counts_the_hour_a_fall_back_repeats_without_use_tz(
    alias: str, settings: Any
) -> None:
    """Suspicion: ``record_run``'s ``last_run_at < slot`` guard drops slots at a DST
    fall-back with ``USE_TZ = False``. Confirmed: the row stores naive local times, which go
    back an hour there, so before the fix the second 01:00 and 01:30 were not counted and
    ``total_run_count`` ended two below the runs. Two nodes record each slot, in order."""
    from django_celery_beat.models import PeriodicTask

    settings.USE_TZ, settings.TIME_ZONE = False, "America/New_York"
    row = _row()
    # 01:00 and 01:30 EDT, then 01:00 and 01:30 EST (the repeated hour), then 02:00 EST
    fires = [_utc(2026, 11, 1, 5), _utc(2026, 11, 1, 5, 30), _utc(2026, 11, 1, 6)]
    fires += [_utc(2026, 11, 1, 6, 30), _utc(2026, 11, 1, 7)]
    for fire in fires:
        for won in (False, True, False):  # a loser first, the winner, a late loser
            periodic_tasks.record_run(row.pk, fire, won=won)
    counted = PeriodicTask.objects.get(pk=row.pk)
    assert counted.total_run_count == len(fires)
    assert counted.last_run_at == datetime(2026, 11, 1, 2, 0)  # naive, New York
