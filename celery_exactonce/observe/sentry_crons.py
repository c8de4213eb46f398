"""Sentry Crons check-ins for beat's occurrences, as Sentry's Celery integration makes them.

Sentry's integration (``CeleryIntegration(monitor_beat_tasks=True)``) patches
stock beat's ``Scheduler.apply_entry``: before each publish it sends an
``in_progress`` check-in and adds ``sentry-monitor-*`` headers to the
message; on the worker, its signal handlers send ``ok`` (``task_success``)
or ``error`` (``task_failure``, ``task_retry``) under the same check-in id.
:class:`~celery_exactonce.beat.scheduler.ExactOnceScheduler` never calls
``apply_entry``, so this module does beat's half:

* each occurrence's job carries the headers in its stored publish options
  (:meth:`Crons.headers`, added as the claim is built): the same on every
  node, as the check-in id derives from the job id, and on every publish of
  the job (a dispatch retried after a rollback, a reconciler's replay), so the
  worker's ``ok`` always names the check-in that was opened;
* the node whose claim won sends the ``in_progress`` check-in, once, just
  before it dispatches (:meth:`Crons.in_progress`); the nodes that found the
  slot claimed send nothing. One occurrence: one ``in_progress``, one ``ok``.

None of this runs, and ``sentry_sdk`` is never imported here, unless the
host app initialised Sentry with the Celery integration and
``monitor_beat_tasks=True``. The monitor slug is the entry's name;
``exclude_beat_tasks`` and the schedules a monitor can follow are Sentry's
own (an interval under a minute or of seconds is not monitored, as under
stock beat). Beat's own entries (the reconciler's) are never monitored.
If Sentry's side fails here (an SDK whose internals differ), check-ins stop
on that node (``crons_failed``, once) and beat goes on.
"""

from __future__ import annotations

import logging
import sys
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from celery_exactonce.core.jobs import Job
from celery_exactonce.observe import metrics
from celery_exactonce.schedules import bounded

SLUG = "sentry-monitor-slug"
CONFIG = "sentry-monitor-config"
CHECK_IN = "sentry-monitor-check-in-id"

#: Check-in ids are derived from job ids in this UUID namespace.
_CHECK_INS = uuid.UUID("5b0e5ad1-3c2c-4f6e-9d43-6b1f0c2a7e10")


def integration() -> Any | None:
    """Sentry's Celery integration, if the host initialised it with ``monitor_beat_tasks``."""
    sentry_sdk = sys.modules.get("sentry_sdk")
    celery_module = sys.modules.get("sentry_sdk.integrations.celery")
    if sentry_sdk is None or celery_module is None:  # never imported: never initialised
        return None
    client = sentry_sdk.get_client()
    if not client.is_active():
        return None
    found = client.get_integration(celery_module.CeleryIntegration)
    if found is None or not getattr(found, "monitor_beat_tasks", False):
        return None
    return found


def check_in_id(job_id: str) -> str:
    """The check-in id of the occurrence ``job_id``: the same on every node."""
    return uuid.uuid5(_CHECK_INS, job_id).hex


class Crons:
    """Sentry Crons for one beat node of ``app`` (see the module docs)."""

    def __init__(self, app: Any) -> None:
        self._app = app
        #: Each entry's monitor config, by entry name, with the schedule it was made of.
        self._configs: dict[str, tuple[str, dict[str, Any]]] = {}
        #: Set once Sentry's side failed here: monitoring is off for this node, beat goes on.
        self._off = False

    def headers(self, name: str, schedule: Any, job_id: str) -> dict[str, Any] | None:
        """The ``sentry-monitor-*`` headers of ``name``'s occurrence ``job_id``, if monitored."""
        if self._off:
            return None
        found = integration()
        if found is None:
            return None
        try:
            from sentry_sdk.utils import match_regex_list

            if match_regex_list(name, found.exclude_beat_tasks):
                return None
            config = self._config(name, schedule)
        except Exception as exc:  # an SDK that differs: no check-ins, never a lost slot
            self._failed(exc)
            return None
        if not config:
            return None
        return {SLUG: name, CONFIG: config, CHECK_IN: check_in_id(job_id)}

    def _failed(self, exc: BaseException) -> None:
        self._off = True
        metrics.event(
            "crons_failed",
            f"Sentry Crons check-ins are off on this beat node: {type(exc).__name__}: {exc}",
            level=logging.WARNING,
            exc_info=exc,
        )

    def _config(self, name: str, schedule: Any) -> dict[str, Any]:
        """Sentry's monitor config of the schedule (empty: Sentry cannot follow it), kept.

        Sentry's own function makes it, as for stock beat; it warns about a
        schedule it cannot follow, so it runs once per entry and schedule.
        """
        if isinstance(schedule, bounded) and not schedule.first_only:
            schedule = schedule.schedule  # a window around a schedule Sentry may know
        seen = f"{type(schedule).__qualname__}:{schedule!r}"
        cached = self._configs.get(name)
        if cached is not None and cached[0] == seen:
            return cached[1]
        from sentry_sdk.integrations.celery.beat import _get_monitor_config

        config = dict(_get_monitor_config(schedule, self._app, name))
        if config:  # app.timezone is a tzinfo: the stored job and the message hold JSON
            config["timezone"] = str(config.get("timezone") or "UTC")
        self._configs[name] = (seen, config)
        return config

    def in_progress(self, jobs: Iterable[Job]) -> None:
        """Open the check-in of each occurrence this node won and is about to dispatch."""
        monitored = [
            headers
            for job in jobs
            if isinstance(headers := job.options.get("headers"), Mapping) and CHECK_IN in headers
        ]
        if not monitored or self._off or integration() is None:
            return
        try:
            from sentry_sdk.crons import MonitorStatus, capture_checkin

            for headers in monitored:
                capture_checkin(
                    monitor_slug=headers[SLUG],
                    monitor_config=headers.get(CONFIG),
                    check_in_id=headers[CHECK_IN],
                    status=MonitorStatus.IN_PROGRESS,
                )
        except Exception as exc:  # never in the way of the dispatch
            self._failed(exc)
