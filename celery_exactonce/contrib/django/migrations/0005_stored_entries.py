"""Stored beat entries (``exactonce_entries``), made as the store makes its tables."""

from __future__ import annotations

from django.db import migrations

from celery_exactonce.contrib.django import tables


class Migration(migrations.Migration):  # type: ignore[misc]  # django is untyped here
    dependencies = (("celery_exactonce", "0004_schema_2"),)
    operations = (migrations.RunPython(tables.create, tables.drop_entries),)
