"""Read-only models of the store's records, for the admin: never written through Django.

Each model is unmanaged. :class:`Job` and :class:`Watermark` read the views
the app's second migration makes (:data:`celery_exactonce.contrib.django.tables.VIEWS`):
the store's table with a one-column key, ``namespace:space:id`` for a job and
``namespace:entry`` for a watermark, as Django's admin needs.
:class:`SkippedSlots` reads its table, which has one. Times are the
store's integer microseconds since the UNIX epoch; :meth:`Job.record` is the
record as the store reads it (:class:`celery_exactonce.core.jobs.Job`).

Jobs are written by the store alone (:mod:`celery_exactonce.contrib.django.store`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, cast

from django.db import models

from celery_exactonce.contrib.django.tables import prefix, view_name
from celery_exactonce.core import jobs, times
from celery_exactonce.dispatch import messages
from celery_exactonce.stores.sql import rows as sql_rows


class Job(models.Model):  # type: ignore[misc]  # django is untyped here
    """One job record of the store (a beat occurrence, a delayed job, a submit)."""

    key = models.CharField(primary_key=True, max_length=300, db_column="pk")
    namespace = models.CharField(max_length=64)
    space = models.CharField(max_length=1)
    job_id = models.CharField("job id", max_length=200, db_column="id")
    task = models.CharField(max_length=255)
    state = models.CharField(max_length=16)
    rev = models.CharField(max_length=255)
    attempt = models.IntegerField()
    run_id = models.CharField(max_length=255, null=True)
    payload = models.TextField()
    entry = models.CharField("beat entry", max_length=255, null=True)
    fire_time = models.BigIntegerField(null=True)
    run_at = models.BigIntegerField(null=True)
    deadline = models.BigIntegerField(null=True)
    created_at = models.BigIntegerField()
    touched_at = models.BigIntegerField()
    heartbeat_at = models.BigIntegerField(null=True)
    terminal_at = models.BigIntegerField(null=True)
    expires_at = models.BigIntegerField(null=True)
    dispatches = models.IntegerField()
    node = models.CharField(max_length=255)
    reason = models.CharField(max_length=500)
    history = models.TextField()

    class Meta:
        managed = False
        db_table = view_name("admin_jobs")
        ordering = ("-touched_at",)
        verbose_name = "job"

    def __str__(self) -> str:
        return f"{self.job_id} ({self.task}, {self.state})"

    def record(self) -> jobs.Job:
        """The record as the store reads it."""
        row = {f.column: getattr(self, f.attname) for f in self._meta.concrete_fields}
        return sql_rows.job_from_row(cast(Any, _Row(row)))

    def idempotency_key(self) -> str:
        """The ``idempotency_key`` the job's messages carry."""
        return messages.job_idempotency_key(self.record(), self.namespace)


class Watermark(models.Model):  # type: ignore[misc]  # django is untyped here
    """How far a beat entry's slots are decided: the last slot claimed."""

    key = models.CharField(primary_key=True, max_length=330, db_column="pk")
    namespace = models.CharField(max_length=64)
    entry = models.CharField("beat entry", max_length=255)
    fire_time = models.BigIntegerField(null=True)

    class Meta:
        managed = False
        db_table = view_name("admin_watermarks")
        ordering = ("entry",)
        verbose_name = "beat entry"
        verbose_name_plural = "beat entries"

    def __str__(self) -> str:
        return self.entry  # type: ignore[no-any-return]


class SkippedSlots(models.Model):  # type: ignore[misc]  # django is untyped here
    """Slots of a beat entry a node skipped in one tick, and why (``note_skipped``)."""

    seq = models.BigAutoField(primary_key=True)
    namespace = models.CharField(max_length=64)
    entry = models.CharField("beat entry", max_length=255)
    reason = models.CharField(max_length=16)
    first_slot = models.BigIntegerField()
    last_slot = models.BigIntegerField()
    slots = models.IntegerField()
    node = models.CharField(max_length=255)
    noted_at = models.BigIntegerField()

    class Meta:
        managed = False
        db_table = f"{prefix()}skipped"
        ordering = ("-seq",)
        verbose_name = "skipped slots"
        verbose_name_plural = "skipped slots"

    def __str__(self) -> str:
        return f"{self.entry}: {self.slots} slot(s) ({self.reason})"


def instant(micros: int | None) -> datetime | None:
    """A stored time (µs since the UNIX epoch) as an aware UTC datetime."""
    return times.from_micros_opt(micros)


class _Row:
    """A model's columns where :func:`sql_rows.job_from_row` reads a database row."""

    def __init__(self, mapping: dict[str, Any]) -> None:
        self._mapping = mapping
