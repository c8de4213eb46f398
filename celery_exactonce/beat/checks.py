"""Beat's checks of an entry, for what checks entries outside beat: the stored entries'
functions and ``exactonce check``.

* :func:`check_beat_entry`: an entry's fields as beat checks them at start (its
  schedule, task, policy, options and the job of a slot), a refusal naming it;
* :func:`fixed_names`: the names only ``beat_schedule`` and beat itself may give
  an entry (a stored entry of such a name is refused);
* :func:`uses_django_rows`: whether ``beat_scheduler`` runs django-celery-beat's
  rows, where stored entries are not read.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any
from zoneinfo import ZoneInfo

from celery import beat

from celery_exactonce.beat import entries
from celery_exactonce.beat.entries import EntryPolicy
from celery_exactonce.beat.scheduler import entry_policy, internal_entries
from celery_exactonce.config import ExactOnceConfig

#: ``beat_scheduler`` values that read django-celery-beat's rows.
DJANGO_SCHEDULERS = frozenset(
    {
        "exactonce-django",
        "celery_exactonce.contrib.django_celery_beat:DatabaseScheduler",
        "celery_exactonce.contrib.django_celery_beat.DatabaseScheduler",
    }
)


def check_beat_entry(
    app: Any,
    config: ExactOnceConfig,
    name: str,
    fields: Any,
    *,
    internal: bool = False,
    node: str = "check",
) -> EntryPolicy:
    """Entry ``name`` of ``fields`` as beat checks it; its policy, or a refusal naming it."""
    tz = ZoneInfo(str(app.timezone))
    with entries.reading(name):
        entry = beat.ScheduleEntry(**dict(fields, name=name, app=app))
        return entries.check_entry(
            name,
            entry,
            lambda n, e: entry_policy(app, config, n, e, internal=internal),
            tz=tz,
            now=datetime.now(timezone.utc),
            namespace=config.namespace,
            node=node,
        )


def fixed_names(app: Any, config: ExactOnceConfig) -> frozenset[str]:
    """The entries of ``beat_schedule`` and beat's own, by name."""
    return frozenset({*(app.conf.beat_schedule or {}), *internal_entries(config)})


def uses_django_rows(app: Any) -> bool:
    """Whether ``beat_scheduler`` is the exactonce-django scheduler (django-celery-beat rows)."""
    scheduler = app.conf.beat_scheduler
    name = scheduler if isinstance(scheduler, str) else getattr(scheduler, "__qualname__", "")
    return name in DJANGO_SCHEDULERS or name == "DatabaseScheduler"
