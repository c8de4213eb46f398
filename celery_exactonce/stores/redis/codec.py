"""The Redis store's encoding: the arguments its scripts take and the replies they give.

A record is a hash: scalar fields as text, times as integer microseconds
since the UNIX epoch, ``args``/``kwargs``/``options`` as opaque JSON and
``history`` a JSON array; absent optional fields (``run_id``, ``run_at``...)
are absent from the hash. A terminal record compacted by the settings
(``exactonce_terminal_history``, ``exactonce_terminal_payload``) has no ``ref``
(its key holds it), and no ``history`` or payload fields as they ask: every
value then fits a listpack (Redis' compact hash encoding, values of at most
``hash-max-listpack-value`` bytes, 64 by default). Here:

* **arguments**: the fields a create writes (:func:`record_fields`), the
  per-job arguments of the ``create`` and ``transition`` scripts
  (:func:`create_args`, :func:`transition_args`), an optional argument
  (:func:`opt`: ``''`` when absent, ``'=' + value`` when present), JSON text
  (:func:`to_json`), a history entry as JSON text open for its store time
  (:func:`history_entry`, :func:`history_tail`), a lease ttl in milliseconds (:func:`lease_ms`);
* **replies**: a record from its ``HGETALL`` reply (:func:`decode_job`), the
  ``create`` and ``transition`` scripts' answers (:func:`create_result`,
  :func:`transition_result`), the ``due_backlog`` script's
  (:func:`due_backlog_result`), a reply as text (:func:`as_text`, either
  ``decode_responses``).

Not here: the keys each call passes (:mod:`~celery_exactonce.stores.redis.keys`
and the store's operations), the ``enqueue`` script's arguments
(:mod:`~celery_exactonce.stores.redis.enqueue`), running the scripts
(:mod:`~celery_exactonce.stores.redis.base`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from celery_exactonce.core import formats, jobs, times
from celery_exactonce.core.jobs import (
    CreateResult,
    CreateStatus,
    Job,
    TransitionResult,
    TransitionStatus,
)
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.stores.base import DueBacklog


def as_text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def due_backlog_result(reply: Sequence[Any]) -> DueBacklog:
    """The ``due_backlog`` script's reply: the count, the oldest ``run_at`` (or ''), store time."""
    count, oldest, now = reply
    first = as_text(oldest)
    return DueBacklog(
        int(count),
        times.from_micros(int(first)) if first else None,
        times.from_micros(int(as_text(now))),
    )


def opt(value: object | None) -> str:
    """An optional script argument: ``''`` when absent, ``'=' + value`` when present."""
    return "" if value is None else f"={value}"


#: ASCII-escaped: a lone surrogate in a string round-trips instead of failing to encode.
#: One encoder for the process (``json.dumps`` with options builds one per call).
_JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def to_json(value: Any) -> str:
    return _JSON.encode(value)


def lease_ms(ttl: float) -> int:
    """A lease ttl in whole milliseconds, at least 1 (``PX 0`` is an error)."""
    return max(1, round(ttl * 1000))


# -- arguments -----------------------------------------------------------------------


def history_entry(src: str | None, dst: str, node: str, reason: str, rev: str) -> str:
    """A history entry as JSON text, open at the end for its time: ``…,"at":"``.

    The text the scripts' ``history_entry`` writes (one ``"rev"`` key, ``at``
    a decimal string), for a script that only has to add the store time.
    """
    return f'{{"from":{to_json(src)},{history_tail(dst, node, reason, rev)}'


def history_tail(dst: str, node: str, reason: str, rev: str, action: str | None = None) -> str:
    """A history entry's JSON text without its opening and ``from``: ``"to":…,"at":"``.

    The ``transition`` script opens it with the state it read and closes it
    with the store time.
    """
    return f'{_entry_fields(dst, node, reason, action)}{to_json(rev)},"at":"'


@functools.lru_cache(maxsize=1024)
def _entry_fields(dst: str, node: str, reason: str, action: str | None) -> str:
    """An entry's fields from ``to`` up to its rev (``"to":…,"rev":``), remembered: a process
    writes few."""
    fields = {"to": dst, "node": node, "reason": reason}
    if action is not None:
        fields["action"] = action
    return to_json({**fields, "rev": ""})[1:-3]


def record_fields(new: NewJob, state: str, rev: str, node: str, reason: str) -> list[Any]:
    """The fields of the record a create of ``new`` writes, but its times and history.

    The payload's texts are the ones ``new`` encoded when it was built, where it kept them.
    """
    texts = new.payload_json
    if texts is None:  # kombu-typed values: stored in kombu's encoding
        texts = (to_json(new.args), to_json(new.kwargs), to_json(new.options))
    fields: list[Any] = [
        "ref",  # first: the enqueue script takes its value as the index member
        str(new.ref),
        "format",
        formats.RECORD_FORMAT,
        "task",
        new.task,
        "state",
        state,
        "rev",
        rev,
        "node",
        node,
        "reason",
        reason,
        "args",
        texts[0],
        "kwargs",
        texts[1],
        "options",
        texts[2],
    ]
    if new.run_id is not None:
        fields += ["run_id", new.run_id]
    if new.entry is not None:
        fields += ["entry", new.entry]
    for name, value in (
        ("fire_time", new.fire_time),
        ("run_at", new.run_at),
        ("deadline", new.deadline),
    ):
        if value is not None:
            fields += [name, times.to_micros(value)]
    if new.signature is not None:
        fields += ["signature", new.signature]
    return fields


def create_args(new: NewJob) -> list[Any]:
    """The ``create`` script's arguments for ``new`` (its key is the record's)."""
    member = str(new.ref)
    fields = record_fields(new, new.state.value, new.rev, new.node, new.reason)
    fire_time = times.to_micros_opt(new.fire_time)
    run_at = times.to_micros_opt(new.run_at)
    return [
        new.entry or "",
        "" if fire_time is None else fire_time,
        member,
        new.state.value,
        "" if run_at is None else run_at,
        new.node,
        new.reason,
        new.rev,
        len(fields),
        *fields,
    ]


def transition_args(ref: JobRef, request: Transition) -> list[Any]:
    """The ``transition`` script's arguments for ``request`` (its keys: the record, the lease)."""
    lease = request.lease
    return [
        str(ref),
        request.to.value,
        ",".join(s.value for s in request.expect),
        request.node,
        request.reason,
        opt(request.rev),
        opt(request.attempt),
        opt(request.run_id),
        opt(lease.token if lease else None),
        opt(None if request.stale_for is None else repr(float(request.stale_for))),
        request.new_rev,
        opt(request.new_run_id),
        "1" if request.next_attempt else "0",
        opt(times.to_micros_opt(request.run_at)),
        opt(None if request.args is None else to_json(request.args)),
        opt(None if request.kwargs is None else to_json(request.kwargs)),
        opt(request.task),
        opt(request.signature),
        history_tail(
            request.to.value,
            request.node,
            request.reason,
            request.new_rev,
            None if request.action is None else request.action.value,
        ),
    ]


# -- replies -------------------------------------------------------------------------


def create_result(reply: Sequence[Any]) -> CreateResult:
    status = CreateStatus(as_text(reply[0]))
    current = None if reply[1] is None else as_text(reply[1])
    return CreateResult(status, decode_job(reply[2]) if len(reply) > 2 else None, epoch=current)


def transition_result(reply: Sequence[Any]) -> TransitionResult:
    status = TransitionStatus(as_text(reply[0]))
    return TransitionResult(status, decode_job(reply[1]) if len(reply) > 1 else None)


def decode_hash(record: Mapping[Any, Any], ref: JobRef) -> Job | None:
    """The job of record ``ref`` from its hash as ``HGETALL`` answers it; ``None`` when empty."""
    return decode_job([item for pair in record.items() for item in pair], ref) if record else None


def decode_job(flat: Sequence[Any], ref: JobRef | None = None) -> Job:
    """A :class:`~celery_exactonce.core.jobs.Job` from a record's ``HGETALL`` reply.

    A compacted terminal record has no ``ref`` field (its key holds it): the
    scripts add it to their replies, and a caller that read the hash itself
    gives ``ref``. Every other field a compacted record dropped decodes as empty.
    """
    data: dict[str, Any] = {
        as_text(flat[i]): as_text(flat[i + 1]) for i in range(0, len(flat) - 1, 2)
    }
    if ref is not None:
        data.setdefault("ref", str(ref))
    formats.refuse_newer("record", data.get("format"), f"job {data.get('ref')}")
    for field in ("args", "kwargs", "options", "history"):
        data[field] = json.loads(data.get(field) or "null")
    return jobs.job_from_json(data)
