"""The admin's read-only views of the jobs and the watermarks, each with a one-column key."""

from __future__ import annotations

from django.db import migrations

from celery_exactonce.contrib.django import tables


class Migration(migrations.Migration):  # type: ignore[misc]  # django is untyped here
    dependencies = (("celery_exactonce", "0001_initial"),)
    # Not atomic: MySQL cannot roll DDL back, and Django refuses DDL inside a block there.
    operations = (migrations.RunPython(tables.create_views, tables.drop_views, atomic=False),)
