"""A data migration: the report every 5 seconds, as a django-celery-beat row."""

from __future__ import annotations

from typing import Any

from django.db import migrations


def add_report(apps: Any, schema_editor: Any) -> None:
    IntervalSchedule = apps.get_model("django_celery_beat", "IntervalSchedule")
    PeriodicTask = apps.get_model("django_celery_beat", "PeriodicTask")
    every_5s, _ = IntervalSchedule.objects.get_or_create(every=5, period="seconds")
    PeriodicTask.objects.get_or_create(
        name="orders-report", defaults={"task": "orders.report", "interval": every_5s}
    )


def remove_report(apps: Any, schema_editor: Any) -> None:
    PeriodicTask = apps.get_model("django_celery_beat", "PeriodicTask")
    PeriodicTask.objects.filter(name="orders-report").delete()


class Migration(migrations.Migration):
    dependencies = [
        ("orders", "0001_initial"),
        ("django_celery_beat", "__latest__"),
    ]
    operations = [migrations.RunPython(add_report, remove_report)]
