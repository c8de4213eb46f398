"""The message format: our headers, and what a message says of its job.

Every message of a job carries ``exactonce_job_id``, ``exactonce_attempt`` and
``idempotency_key`` in its headers; a beat occurrence's also ``exactonce_key``
and ``exactonce_fire_time``; a delivery the gate sent back also
``exactonce_gate_runs`` (docs/design/protocol.md, "Dispatch" and "The worker
gate"). The dispatcher writes them (:func:`message_headers`), the gate reads
them (:func:`headers_of`, :func:`ref_from_headers`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery_exactonce import jobs, keys
from celery_exactonce.jobs import Job, JobRef, Space

HEADER_JOB_ID = "exactonce_job_id"
HEADER_ATTEMPT = "exactonce_attempt"
HEADER_IDEMPOTENCY_KEY = "idempotency_key"
HEADER_KEY = "exactonce_key"
HEADER_FIRE_TIME = "exactonce_fire_time"
#: Header carrying the run ids that earlier deliveries of this message wrote
#: (or may have written) at the gate before a store error sent them back.
HEADER_GATE_RUNS = "exactonce_gate_runs"

#: Job option (stored, never published as an option): the Celery ``task_id`` of
#: the job's messages when it differs from the job id. A task's replacement
#: (``Task.replace``) takes the replaced task's id, whose job already exists: its
#: job gets an id of its own (:func:`replacement_job_id`), its messages that id.
MESSAGE_ID_OPTION = "exactonce_message_id"


def job_idempotency_key(job: Job, namespace: str) -> str:
    """The ``idempotency_key`` header of ``job``.

    For a beat occurrence: :func:`~celery_exactonce.keys.idempotency_key` of
    its entry and slot. For any other job: that of ``"job:" + task_id`` at the
    UNIX epoch, so it is the same across retries and re-submissions of the id.
    """
    if job.entry is not None and job.fire_time is not None:
        return keys.idempotency_key(job.entry, job.fire_time, namespace)
    return keys.idempotency_key(f"job:{job.ref.id}", jobs.EPOCH, namespace)


def message_headers(job: Job, namespace: str) -> dict[str, Any]:
    """The headers every dispatch of ``job`` carries (docs/design/protocol.md, "Dispatch")."""
    headers: dict[str, Any] = {
        HEADER_JOB_ID: job.ref.id,
        HEADER_ATTEMPT: job.attempt,
        HEADER_IDEMPOTENCY_KEY: job_idempotency_key(job, namespace),
    }
    if job.ref.space is Space.OCCURRENCE and job.fire_time is not None:
        headers[HEADER_KEY] = job.entry
        headers[HEADER_FIRE_TIME] = keys.canonical_instant(job.fire_time)
    return headers


def replacement_job_id(task_id: str, nesting: int) -> str:
    """The job id of the task that replaces ``task_id`` at ``replaced_task_nesting`` ``nesting``.

    Deterministic, so a replacement submitted again (a re-run of the replaced
    body) finds its job instead of creating a second one.
    """
    return f"{task_id}~replaced~{nesting}"


def message_task_id(job: Job) -> str:
    """The Celery ``task_id`` every message of ``job`` carries."""
    return str(job.options.get(MESSAGE_ID_OPTION) or job.ref.id)


def ref_from_headers(headers: Mapping[str, Any], task_id: str) -> JobRef:
    """The job a message belongs to: an occurrence if it carries ``exactonce_key``."""
    job_id = str(headers.get(HEADER_JOB_ID) or task_id)
    if headers.get(HEADER_KEY) is not None:
        return JobRef.occurrence(job_id)
    return JobRef.task(job_id)


def headers_of(request: Any) -> dict[str, Any]:
    """Our headers of a delivery (a Celery request, or its dict), at its top level or nested."""
    names = (
        HEADER_JOB_ID, HEADER_ATTEMPT, HEADER_IDEMPOTENCY_KEY,
        HEADER_KEY, HEADER_FIRE_TIME, HEADER_GATE_RUNS,
    )  # fmt: skip
    if isinstance(request, Mapping):
        nested = request.get("headers") or {}
        top: Mapping[str, Any] = request
    else:
        nested = getattr(request, "headers", None) or {}
        top = vars(request) if hasattr(request, "__dict__") else {}
    found = {}
    for name in names:
        value = top.get(name)
        if value is None and isinstance(nested, Mapping):
            value = nested.get(name)
        if value is not None:
            found[name] = value
    return found
