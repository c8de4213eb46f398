"""Schema version 2: the jobs table's indexes, by the store's own upgrade (and back)."""

from __future__ import annotations

from django.db import migrations

from celery_exactonce.contrib.django import tables


class Migration(migrations.Migration):  # type: ignore[misc]  # django is untyped here
    dependencies = (("celery_exactonce", "0003_skipped_slots"),)
    operations = (migrations.RunPython(tables.create, tables.downgrade_to_1),)
