"""The message format: our headers, and what a message says of its job.

Every message of a job carries ``exactonce_job_id``, ``exactonce_attempt`` and
``idempotency_key`` in its headers; a beat occurrence's also ``exactonce_key``
and ``exactonce_fire_time``; a delivery the gate sent back also
``exactonce_gate_runs``, and a copy requeued by ``Reject(requeue=True)``
``exactonce_requeued`` (docs/design/protocol.md, "Dispatch" and "The worker
gate"). The dispatcher writes them (:func:`message_headers`), the gate reads
them (:func:`headers_of`, :func:`ref_from_headers`). The job options that are
ours and never published (:data:`INTERNAL_OPTIONS`) and the ``send_task``
options a job may not set (:func:`check_options`) live here too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery_exactonce.core import exceptions, keys, times
from celery_exactonce.core.formats import MESSAGE_FORMAT
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef, Space
from celery_exactonce.core.writes import UNIQUE_OPTION
from celery_exactonce.observe.traces import TRACE_OPTION

HEADER_JOB_ID = "exactonce_job_id"
HEADER_ATTEMPT = "exactonce_attempt"
HEADER_IDEMPOTENCY_KEY = "idempotency_key"
HEADER_KEY = "exactonce_key"
HEADER_FIRE_TIME = "exactonce_fire_time"
#: The format of our headers (:mod:`celery_exactonce.core.formats`): a worker refuses newer.
HEADER_FORMAT = "exactonce_format"
#: Header carrying the run ids that earlier deliveries of this message wrote
#: (or may have written) at the gate before a store error sent them back.
HEADER_GATE_RUNS = "exactonce_gate_runs"
#: Header of the copy a ``Reject(requeue=True)`` publishes for the next attempt:
#: the body sees that delivery as redelivered, as it would a message given back.
HEADER_REQUEUED = "exactonce_requeued"

#: Job option (stored, never published as an option): the Celery ``task_id`` of
#: the job's messages when it differs from the job id. A task's replacement
#: (``Task.replace``) takes the replaced task's id, whose job already exists: its
#: job gets an id of its own (:func:`replacement_job_id`), its messages that id.
MESSAGE_ID_OPTION = "exactonce_message_id"

#: Job option (stored with the job, never published) telling that the consumer
#: runs the gate for this task. Written by whoever creates the job, from what it
#: knows of the task; every later reader (a beat sweeping delayed jobs, the
#: reconciler) goes by the record, never by its own task registry.
GATED_OPTION = "exactonce_gated"
#: Job option (stored, never published): the task's own reconciler policy as its
#: creator saw it (``exactonce_dispatch_deadline``, ``exactonce_redispatch``...),
#: so a process that does not import the task still applies it.
POLICY_OPTION = "exactonce_policy"

#: Stored job options that are ours and never go to ``send_task``.
INTERNAL_OPTIONS = frozenset(
    {GATED_OPTION, POLICY_OPTION, MESSAGE_ID_OPTION, TRACE_OPTION, UNIQUE_OPTION}
)

#: ``send_task`` keywords that belong to one call (the caller's), never stored:
#: ``result_cls`` builds the result it returns, ``add_to_parent`` adds that result to
#: the worker task that submits (only the submitting process has one).
CALL_OPTIONS = frozenset({"result_cls", "add_to_parent"})

#: Options the dispatch path passes to ``send_task`` itself (or that name a
#: process-local object): a job or beat entry that sets one is refused.
RESERVED_OPTIONS = frozenset(
    {
        "args",
        "kwargs",
        "task_id",
        "producer",
        "retries",
        "retry",
        "name",
        "connection",
        "router",
        "result_cls",
        "publisher",
        UNIQUE_OPTION,  # the task's exactonce_unique makes it
    }
)


def check_options(options: Mapping[str, Any], *, context: str) -> None:
    """Refuse publish options the dispatch path cannot pass on; ``InvalidPayload`` naming it.

    ``send_task`` keywords the dispatch sets itself (``retry``: kombu's publish
    retry is always off; ``retries``: the job's attempt; ``task_id``...) and a
    ``headers`` that is not a dict of string keys. Whether each value can be
    stored as JSON is checked when the job is built (:class:`~celery_exactonce.core.writes.NewJob`).
    """
    reserved = sorted(RESERVED_OPTIONS.intersection(options))
    if reserved:
        raise exceptions.InvalidPayload(
            f"{context}: option {reserved[0]!r} cannot be set: the dispatch path sets it itself "
            f"(options it refuses: {', '.join(sorted(RESERVED_OPTIONS))})"
        )
    headers = options.get("headers")
    if headers is not None and (
        not isinstance(headers, Mapping) or not all(isinstance(k, str) for k in headers)
    ):
        raise exceptions.InvalidPayload(
            f"{context}: option 'headers' must be a dict with string keys, "
            f"got {type(headers).__name__}"
        )


def job_idempotency_key(job: Job, namespace: str) -> str:
    """The ``idempotency_key`` header of ``job``.

    For a beat occurrence: :func:`~celery_exactonce.core.keys.idempotency_key` of
    its entry and slot. For any other job: that of ``"job:" + task_id`` at the
    UNIX epoch, so it is the same across retries and re-submissions of the id.
    """
    if job.entry is not None and job.fire_time is not None:
        return keys.idempotency_key(job.entry, job.fire_time, namespace)
    return submitted_key(job.ref.id, namespace)


def submitted_key(task_id: str, namespace: str) -> str:
    """The idempotency key of the job ``task_id`` submitted (not a beat occurrence)."""
    if type(namespace) is not str or not namespace:  # refused, as idempotency_key refuses it
        return keys.idempotency_key(f"job:{task_id}", times.UNIX_EPOCH, namespace)
    return keys.digest(f"job:{task_id}", _EPOCH_INSTANT, namespace)


#: The canonical text of the instant every submitted job's key is derived at.
_EPOCH_INSTANT = keys.canonical_instant(times.UNIX_EPOCH)


def message_headers(job: Job, namespace: str) -> dict[str, Any]:
    """The headers every dispatch of ``job`` carries (docs/design/protocol.md, "Dispatch")."""
    headers: dict[str, Any] = {
        HEADER_JOB_ID: job.ref.id,
        HEADER_ATTEMPT: job.attempt,
        HEADER_IDEMPOTENCY_KEY: job_idempotency_key(job, namespace),
        HEADER_FORMAT: MESSAGE_FORMAT,
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
    """The job a message belongs to: an occurrence if it carries ``exactonce_key``.

    An occurrence's ref carries that entry key as its routing hint (a sharded
    store's first place to look: :attr:`~celery_exactonce.core.refs.JobRef.entry_hint`).
    """
    job_id = str(headers.get(HEADER_JOB_ID) or task_id)
    entry = headers.get(HEADER_KEY)
    if entry is not None:
        return JobRef.occurrence(job_id, entry_hint=entry)
    return JobRef.submitted(job_id)


def headers_of(request: Any) -> dict[str, Any]:
    """Our headers of a delivery (a Celery request, or its dict), at its top level or nested."""
    names = (
        HEADER_JOB_ID,
        HEADER_ATTEMPT,
        HEADER_IDEMPOTENCY_KEY,
        HEADER_KEY,
        HEADER_FIRE_TIME,
        HEADER_GATE_RUNS,
        HEADER_REQUEUED,
        HEADER_FORMAT,
    )
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
