"""The store's tables (jobs, watermarks, leases, meta, schema version), made as the store does."""

from __future__ import annotations

from django.db import migrations

from celery_exactonce.contrib.django import tables


class Migration(migrations.Migration):  # type: ignore[misc]  # django is untyped here
    initial = True
    dependencies: tuple[tuple[str, str], ...] = ()
    operations = (migrations.RunPython(tables.create, tables.drop),)
