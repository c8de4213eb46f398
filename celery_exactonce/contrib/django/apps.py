"""The Django app's configuration."""

from __future__ import annotations

from django.apps import AppConfig


class ExactOnceConfig(AppConfig):  # type: ignore[misc]  # django is untyped here
    name = "celery_exactonce.contrib.django"
    label = "celery_exactonce"
    verbose_name = "celery-exactonce"
    default_auto_field = "django.db.models.AutoField"
