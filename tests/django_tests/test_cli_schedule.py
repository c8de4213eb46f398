"""``celery exactonce schedule`` on django-celery-beat's rows (the exactonce-django scheduler).

In process (click's runner on the command group, the app handed in as Celery's
CLI context hands it): the rows must be read from the database, a row beat
refuses shown with its error, and the ``beat_schedule`` entries no row holds
kept. Fails before the CLI knew the rows: only ``beat_schedule`` was shown.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from celery import Celery
from click.testing import CliRunner

from celery_exactonce.cli import exactonce


def _app(**conf: Any) -> Celery:
    app = Celery("cli_django", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        exactonce_store_url="memory://",
        beat_scheduler="exactonce-django",
        timezone="UTC",
        **conf,
    )
    return app


def test_schedule_lists_the_rows_and_the_settings_entries_no_row_holds(alias: str) -> None:
    from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask

    every = IntervalSchedule.objects.create(every=15, period="minutes")
    PeriodicTask.objects.create(name="sync", task="plain.sync", interval=every)
    nightly = CrontabSchedule.objects.create(minute="30", hour="2")
    PeriodicTask.objects.create(name="report", task="plain.report", crontab=nightly)
    PeriodicTask.objects.create(name="broken", task="plain.b", interval=every, args="not json")
    PeriodicTask.objects.create(name="off", task="plain.off", interval=every, enabled=False)
    app = _app(beat_schedule={"from-settings": {"task": "plain.s", "schedule": 60.0}})

    result = CliRunner().invoke(
        exactonce, ["schedule", "--json", "--count", "2"], obj=SimpleNamespace(app=app)
    )
    assert result.exit_code == 0, result.output
    entries = {e["entry"]: e for e in json.loads(result.output)["entries"]}
    assert set(entries) == {
        "sync",
        "report",
        "broken",
        "from-settings",
        "celery_exactonce.reconcile",
    }
    assert entries["sync"]["source"] == entries["report"]["source"] == "row"
    assert entries["from-settings"]["source"] == "settings"
    assert all(slot.endswith(":30:00+00:00") for slot in entries["report"]["next"])
    assert len(entries["sync"]["next"]) == 2
    assert "args" in entries["broken"]["error"] and entries["broken"]["next"] == []
