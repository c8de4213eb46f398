"""The SQL job store's rows and jobs: the ``jobs`` row of a record, and the record of a row.

Every time is a ``BIGINT`` of integer microseconds since the UNIX epoch. The
``payload`` column holds args, kwargs, options and the signature as JSON, or
``''`` on a terminal record that keeps none (schema version 2).
"""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa

from celery_exactonce.core import times
from celery_exactonce.core.jobs import HistoryEntry, Job
from celery_exactonce.core.payload import encode_payload
from celery_exactonce.core.refs import JobRef, Space
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob


def job_values(
    job: Job,
    namespace: str,
    retention: float,
    *,
    key: bool = True,
    payload: str | None = None,
    history: bool = True,
) -> dict[str, Any]:
    """The ``jobs`` row of ``job`` (without the primary key unless ``key``).

    ``expires_at`` is set only on terminal records: ``max(fire_time, terminal_at) + retention``.
    ``payload``: the ``payload`` column's text already encoded (:func:`new_payload`), if it is.
    Not ``history``: without the ``history`` column (a statement that writes it in pieces).
    """
    values: dict[str, Any] = {
        "task": job.task,
        "state": job.state.value,
        "rev": job.rev,
        "attempt": job.attempt,
        "run_id": job.run_id,
        "payload": payload or payload_text(job),
        "entry": job.entry,
        "fire_time": times.to_micros_opt(job.fire_time),
        "run_at": times.to_micros_opt(job.run_at),
        "deadline": times.to_micros_opt(job.deadline),
        "created_at": times.to_micros(job.created_at),
        "touched_at": times.to_micros(job.touched_at),
        "heartbeat_at": times.to_micros_opt(job.heartbeat_at),
        "terminal_at": times.to_micros_opt(job.terminal_at),
        "expires_at": times.to_micros_opt(job.expires_at(retention)),
        "dispatches": job.dispatches,
        "node": job.node,
        "reason": job.reason,
    }
    if history:
        values["history"] = json.dumps([h.to_json() for h in job.history], separators=(",", ":"))
    if key:
        values.update(namespace=namespace, space=job.ref.space.value, id=job.ref.id)
    return values


def job_from_row(row: sa.Row[Any]) -> Job:
    """Inverse of :func:`job_values`."""
    m = row._mapping
    payload = json.loads(m["payload"]) if m["payload"] else EMPTY_PAYLOAD
    return Job(
        ref=JobRef(Space(m["space"]), m["id"]),
        task=m["task"],
        state=State(m["state"]),
        rev=m["rev"],
        attempt=int(m["attempt"]),
        run_id=m["run_id"],
        args=list(payload["args"]),
        kwargs=dict(payload["kwargs"]),
        options=dict(payload["options"]),
        entry=m["entry"],
        fire_time=times.from_micros_opt(m["fire_time"]),
        run_at=times.from_micros_opt(m["run_at"]),
        deadline=times.from_micros_opt(m["deadline"]),
        created_at=times.from_micros(m["created_at"]),
        touched_at=times.from_micros(m["touched_at"]),
        heartbeat_at=times.from_micros_opt(m["heartbeat_at"]),
        terminal_at=times.from_micros_opt(m["terminal_at"]),
        dispatches=int(m["dispatches"]),
        node=m["node"],
        reason=m["reason"],
        history=tuple(HistoryEntry.from_json(h) for h in json.loads(m["history"])),
        signature=payload.get("signature") or None,
    )


#: The payload a terminal record that keeps none holds (``exactonce_terminal_payload``):
#: ``''`` in the column, read as no args, kwargs or options (since schema version 2).
COMPACT_PAYLOAD = ""
EMPTY_PAYLOAD: dict[str, Any] = {"args": [], "kwargs": {}, "options": {}}


def payload_text(job: Job) -> str:
    """The ``payload`` column of ``job``: :data:`COMPACT_PAYLOAD` for a terminal job with none."""
    document = payload_document(job)
    if job.terminal and document == EMPTY_PAYLOAD:
        return COMPACT_PAYLOAD
    return encode_payload(document, context=str(job.ref))


def new_payload(new: NewJob) -> str | None:
    """The ``payload`` column of the record a create of ``new`` writes, from the texts ``new``
    encoded when it was built (:attr:`NewJob.payload_json`); ``None`` if it kept none."""
    texts = new.payload_json
    if texts is None:
        return None
    signed = "" if new.signature is None else f',"signature":{json.dumps(new.signature)}'
    return f'{{"args":{texts[0]},"kwargs":{texts[1]},"options":{texts[2]}{signed}}}'


def payload_document(job: Job) -> dict[str, Any]:
    """The ``payload`` column's JSON: args, kwargs, options, and the signature if any.

    The signature lives in the document it signs, so one write changes both,
    and tables of schema version 1 hold it without an upgrade (a reader that
    does not know the key ignores it).
    """
    document = job.payload
    if job.signature is not None:
        document["signature"] = job.signature
    return document
