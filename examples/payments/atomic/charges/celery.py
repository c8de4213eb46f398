"""The example's Celery app, configured from Django's settings (``CELERY_*``)."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "charges.settings")

app = Celery("charges")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["charges"])
