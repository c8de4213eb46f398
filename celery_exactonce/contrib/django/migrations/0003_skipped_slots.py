"""The records of skipped slots (``exactonce_skipped``), made as the store makes its tables."""

from __future__ import annotations

from django.db import migrations

from celery_exactonce.contrib.django import tables


class Migration(migrations.Migration):  # type: ignore[misc]  # django is untyped here
    dependencies = (("celery_exactonce", "0002_admin_views"),)
    operations = (migrations.RunPython(tables.create, tables.drop_skipped),)
