"""Unique submissions' keys (``exactonce_unique``), made as the store makes its tables."""

from __future__ import annotations

from django.db import migrations

from celery_exactonce.contrib.django import tables


class Migration(migrations.Migration):  # type: ignore[misc]  # django is untyped here
    dependencies = (("celery_exactonce", "0005_stored_entries"),)
    operations = (migrations.RunPython(tables.create, tables.drop_unique),)
