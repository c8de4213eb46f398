"""What the options of an ``apply_async`` call become in a job: stored options, eta, deadline.

Options that belong to the call (process-local objects, kombu's publish
retry, the times) are not stored; everything else is stored as JSON with the
job and published with every dispatch of it. ``eta``/``countdown`` become the
job's ``run_at`` and ``expires`` its deadline, read as Celery reads them. Not
here: the submit itself (:mod:`~celery_exactonce.task.base`).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

from celery_exactonce.core import payload
from celery_exactonce.dispatch import messages

#: Options of ``apply_async`` that belong to this call and are not stored:
#: process-local objects, kombu's publish retry (always off for us), and the
#: times that become the job's ``eta`` and ``deadline``. Everything else (queue,
#: priority, headers, link, chain, chord, root and parent ids...) is stored as
#: JSON with the job and published with every dispatch of it.
LOCAL_OPTIONS = frozenset(
    {
        "producer",
        "connection",
        "router",
        "publisher",
        "retry",
        "retry_policy",
        "countdown",
        "eta",
        "expires",
        "task_id",
        "retries",
        *messages.CALL_OPTIONS,
    }
)


#: Options that place a job in a canvas: the group or chord it is a part of, and
#: the rest of its chain.
CANVAS_OPTIONS = ("group_id", "chord", "chain")


def canvas(options: Mapping[str, Any], name: str) -> str:
    """Canvas option ``name`` of a job (stored or about to be), comparable across the two."""
    return payload.encode_payload({name: options.get(name)}, context="canvas options")


def storable_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options of an ``apply_async`` call to store with the job (JSON-able)."""
    stored: dict[str, Any] = {}
    for name, value in options.items():
        if name in LOCAL_OPTIONS or value is None:
            continue
        routed_by_name = name in ("queue", "exchange") and hasattr(value, "name")
        stored[name] = value.name if routed_by_name else value  # a kombu Queue/Exchange
    return stored


def eta_of(options: Mapping[str, Any]) -> datetime | None:
    eta = options.get("eta")
    if isinstance(eta, str):
        eta = _iso(eta)
    if isinstance(eta, datetime):
        return eta if eta.tzinfo else eta.replace(tzinfo=timezone.utc)
    countdown = options.get("countdown")
    if countdown is not None:
        return datetime.now(timezone.utc) + timedelta(seconds=float(countdown))
    return None


def _iso(text: str) -> datetime:
    """An ISO 8601 time (a ``Z`` suffix too, which Python 3.10 does not read)."""
    return datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)


def deadline_of(expires: Any) -> datetime | None:
    """The job's deadline from ``expires``: a time, or seconds from the call, as in Celery.

    Seconds count from the call, not from the eta: ``countdown=60, expires=30``
    expires before it is due, and is never run.
    """
    if expires is None:
        return None
    if isinstance(expires, str):  # ISO 8601, as Celery's apply_async takes it; or seconds
        try:
            expires = float(expires)
        except ValueError:
            expires = _iso(expires)
    if isinstance(expires, datetime):
        return expires if expires.tzinfo else expires.replace(tzinfo=timezone.utc)
    return datetime.now(timezone.utc) + timedelta(seconds=float(expires))
