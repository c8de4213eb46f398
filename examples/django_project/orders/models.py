"""An order, and one row per run of the report (what the example checks)."""

from __future__ import annotations

from django.db import models


class Order(models.Model):
    customer = models.CharField(max_length=100)
    created = models.DateTimeField(auto_now_add=True)


class ReportRun(models.Model):
    """One run of the report task's body: the occurrence it ran for, and who ran it."""

    key = models.CharField(max_length=200)
    fire_time = models.CharField(max_length=40)
    idempotency_key = models.CharField(max_length=64)
    ran_at = models.DateTimeField(auto_now_add=True)
