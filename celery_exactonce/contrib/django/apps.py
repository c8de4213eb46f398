"""The Django app's configuration."""

from __future__ import annotations

from django.apps import AppConfig, apps


class ExactOnceConfig(AppConfig):  # type: ignore[misc]  # django is untyped here
    name = "celery_exactonce.contrib.django"
    label = "celery_exactonce"
    verbose_name = "celery-exactonce"
    default_auto_field = "django.db.models.AutoField"

    def ready(self) -> None:
        """With django-celery-beat: its "Periodic tasks" page knows ``exactonce-django``."""
        if apps.is_installed("django_celery_beat"):
            from celery_exactonce.contrib.django import beat_admin

            beat_admin.install()
