"""Payload signing: an HMAC on every stored job, checked before anything is published.

Anyone who can write the job store could otherwise make workers run any task
with any arguments: a dispatch publishes the stored record. With
``exactonce_signing_key`` set, every record this process writes carries an
HMAC-SHA256 signature, and the dispatcher refuses to publish a record whose
signature does not verify: the job ends ``FAILED`` (reason ``signature
invalid: ...``), the refusal is counted (``signature_invalid``) and logged at
ERROR, and nothing reaches the broker.

What is signed (:func:`signed_content`): the job reference, the task name,
args, kwargs, options (the stored publish options: queue, routing, links,
shadow name...), the beat entry and slot, and the deadline (the message's
``expires``): everything a publish sends. Not signed: the state and the
bookkeeping of the job's life (revs, attempts, times, history), which the
store's guards protect, and ``run_at`` (when a delayed job is due: changing it
can move a run, never change what runs or run it twice).

Keys rotate: ``exactonce_signing_key`` may be a list; the first key signs,
every key verifies. A signature is ``v1:`` followed by the hex HMAC.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from celery_exactonce.core import exceptions, times
from celery_exactonce.core.jobs import CreateResult, Job, TransitionResult
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.skipped_slots import SkippedSlots
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.stores.base import (
    UNCHECKED,
    DueBacklog,
    StateStore,
    Unchecked,
    partitions_of,
)

#: Prefix of every signature this version writes (the scheme, should it change).
SCHEME = "v1"
#: Shortest signing key accepted (characters).
MIN_KEY_LENGTH = 16
#: The ``reason`` of a job refused for its signature starts with this.
REASON = "signature invalid"


def signed_content(record: Job | NewJob) -> bytes:
    """The canonical bytes a signature covers (sorted-key, compact, ASCII JSON)."""
    content = {
        "scheme": SCHEME,
        "ref": str(record.ref),
        "task": record.task,
        "args": list(record.args),
        "kwargs": dict(record.kwargs),
        "options": dict(record.options),
        "entry": record.entry,
        "fire_time": times.to_micros_opt(record.fire_time),
        "deadline": times.to_micros_opt(record.deadline),
    }
    return json.dumps(content, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def normalize_keys(value: object, setting: str = "exactonce_signing_key") -> tuple[str, ...]:
    """The keys of a signing-key setting: a string, or a non-empty list/tuple of strings.

    Raises :class:`~celery_exactonce.core.exceptions.ConfigurationError` naming
    ``setting`` (and a bad key by its position, never by its value).
    """
    keys = (value,) if isinstance(value, str) else value
    if not isinstance(keys, (list, tuple)) or not keys:
        raise exceptions.ConfigurationError(
            f"{setting} must be a string or a non-empty list of strings, "
            f"got {type(value).__name__}",
            setting=setting,
        )
    for i, key in enumerate(keys):
        where = setting if isinstance(value, str) else f"{setting}[{i}]"
        if not isinstance(key, str):
            raise exceptions.ConfigurationError(
                f"{where} must be a string, got {type(key).__name__}", setting=setting
            )
        if len(key) < MIN_KEY_LENGTH:
            raise exceptions.ConfigurationError(
                f"{where} must be at least {MIN_KEY_LENGTH} characters", setting=setting
            )
    return tuple(keys)


#: The field of a stored entry's definition that holds its signature.
ENTRY_SIGNATURE = "signature"
#: The field of a definition that says why beat must refuse the entry (and nothing else).
ENTRY_REFUSED = "refused"


def _entry_content(name: str, fields: object) -> bytes:
    return json.dumps([name, fields], separators=(",", ":"), sort_keys=True).encode()


class Signer:
    """Signs with the first of ``keys`` and verifies with any of them.

    Parameters
    ----------
    keys
        One key, or several (the new one first) while a rotation is under way.
    """

    def __init__(self, keys: str | Sequence[str]) -> None:
        self._keys = tuple(key.encode() for key in normalize_keys(keys))

    def __repr__(self) -> str:
        return f"Signer(<{len(self._keys)} key(s)>)"

    @classmethod
    def from_setting(cls, value: str | Sequence[str] | None) -> Signer | None:
        """A signer for ``exactonce_signing_key``, or ``None`` when it is unset."""
        return None if value is None else cls(value)

    def sign(self, record: Job | NewJob) -> str:
        """The signature of ``record`` under the current (first) key."""
        return self._digest(self._keys[0], signed_content(record))

    def problem(self, record: Job) -> str | None:
        """Why ``record`` must not be published, or ``None`` when its signature verifies."""
        signature = record.signature
        if not signature:
            return f"{REASON}: the record is not signed (a signing key is configured)"
        content = signed_content(record)
        for key in self._keys:
            if hmac.compare_digest(signature.encode(), self._digest(key, content).encode()):
                return None
        return (
            f"{REASON}: the record does not match its signature "
            "(changed in the store, or signed with a key no longer configured)"
        )

    def verify(self, record: Job) -> bool:
        """Whether ``record`` carries a signature made with one of the keys."""
        return self.problem(record) is None

    def sign_new(self, new: NewJob) -> NewJob:
        """``new`` with its signature (one it had is replaced)."""
        return dataclasses.replace(new, signature=self.sign(new))

    def sign_entry(self, name: str, definition: str) -> str:
        """A stored entry's ``definition`` (a JSON object's text) with its signature in it.

        The signature covers the entry's name too: a definition moved under
        another name does not verify.
        """
        fields = json.loads(definition)
        fields.pop(ENTRY_SIGNATURE, None)
        fields[ENTRY_SIGNATURE] = self._digest(self._keys[0], _entry_content(name, fields))
        return json.dumps(fields, separators=(",", ":"), sort_keys=True)

    def verified_entry(self, name: str, definition: str) -> str:
        """A stored entry's definition without its signature, if that verifies; else a
        definition beat refuses, saying why (:data:`ENTRY_REFUSED`)."""
        try:
            fields = json.loads(definition)
            signature = str(fields.pop(ENTRY_SIGNATURE, ""))
        except (ValueError, AttributeError):
            return json.dumps({ENTRY_REFUSED: "its definition is not a JSON object"})
        content = _entry_content(name, fields)
        for key in self._keys:
            if hmac.compare_digest(signature.encode(), self._digest(key, content).encode()):
                return json.dumps(fields, separators=(",", ":"), sort_keys=True)
        why = "is not signed" if not signature else "does not match its signature"
        return json.dumps({ENTRY_REFUSED: f"{REASON}: the stored entry {why}"})

    @staticmethod
    def _digest(key: bytes, content: bytes) -> str:
        return f"{SCHEME}:{hmac.new(key, content, hashlib.sha256).hexdigest()}"


def signed(store: StateStore, keys: str | Sequence[str] | None) -> StateStore:
    """``store`` wrapped in a :class:`SigningStore` when ``keys`` (the setting) are set."""
    signer = Signer.from_setting(keys)
    return store if signer is None else SigningStore(store, signer)


class SigningStore:
    """A :class:`~celery_exactonce.stores.base.StateStore` that signs what it writes.

    Wraps the store of a process whose config sets ``exactonce_signing_key``
    (:class:`~celery_exactonce.runtime.Runtime` does it), so every writer
    (beat claims, ``apply_async``, jobs adopted at the gate, Celery retries)
    signs without knowing about it:

    * a create is signed before it is sent (unless its writer signed it);
    * a transition that changes args or kwargs (a Celery retry) is signed
      over the record it produces. The record is read first and must verify:
      a record someone tampered with is never re-signed (the transition then
      goes unsigned, and the dispatcher refuses what it produced).

    Everything else, and any attribute of the wrapped store beyond the
    contract, goes to the wrapped store unchanged.
    """

    def __init__(self, store: StateStore, signer: Signer) -> None:
        self.inner = store
        self.signer = signer

    def __repr__(self) -> str:
        return f"SigningStore({self.inner!r})"

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def namespace(self) -> str:
        return self.inner.namespace

    @property
    def retention(self) -> float:
        return self.inner.retention

    def now(self) -> datetime:
        return self.inner.now()

    def setup(self) -> None:
        self.inner.setup()

    def schema_version(self) -> int | None:
        return self.inner.schema_version()

    def epoch(self, *, replace: str | None = None) -> str:
        return self.inner.epoch(replace=replace)

    def create(self, new: NewJob, *, epoch: str | None = None) -> CreateResult:
        return self.inner.create(self._signed_new(new), epoch=epoch)

    def create_unique(self, new: NewJob) -> CreateResult:
        result: CreateResult = self.inner.create_unique(self._signed_new(new))  # type: ignore[attr-defined]
        return result

    def create_many(
        self, news: Sequence[NewJob], *, epoch: str | None = None, brief: bool = False
    ) -> list[CreateResult]:
        signed = [self._signed_new(new) for new in news]
        return self.inner.create_many(signed, epoch=epoch, brief=brief)

    def get(self, ref: JobRef) -> Job | None:
        return self.inner.get(ref)

    def transition(self, ref: JobRef, request: Transition) -> TransitionResult:
        return self.inner.transition(ref, self._signed(ref, request))

    def transition_many(
        self, requests: Sequence[tuple[JobRef, Transition]], *, brief: bool = False
    ) -> list[TransitionResult]:
        signed = [(ref, self._signed(ref, request)) for ref, request in requests]
        return self.inner.transition_many(signed, brief=brief)

    def heartbeat(self, ref: JobRef, run_id: str) -> bool:
        return self.inner.heartbeat(ref, run_id)

    def annotate(self, ref: JobRef, *, node: str, reason: str, op_id: str) -> bool:
        return self.inner.annotate(ref, node=node, reason=reason, op_id=op_id)

    def watermark(self, entry: str) -> datetime | None:
        return self.inner.watermark(entry)

    def watermarks(self, entries: Sequence[str]) -> dict[str, datetime]:
        return self.inner.watermarks(entries)

    def note_skipped(self, skipped: Sequence[SkippedSlots]) -> None:
        self.inner.note_skipped(skipped)

    def skipped(self, limit: int = 100) -> list[SkippedSlots]:
        return self.inner.skipped(limit)

    def count_by_state(self) -> dict[State, int]:
        return self.inner.count_by_state()

    def due_backlog(self) -> DueBacklog:
        return self.inner.due_backlog()

    def list_stale(
        self,
        state: State,
        older_than: float,
        limit: int,
        *,
        after: tuple[datetime, JobRef] | None = None,
    ) -> list[Job]:
        return self.inner.list_stale(state, older_than, limit, after=after)

    def list_jobs(
        self,
        state: State,
        limit: int,
        *,
        after: tuple[datetime, JobRef] | None = None,
        older_than: float = 0.0,
        task: str | None = None,
        entry: str | None = None,
    ) -> list[Job]:
        return self.inner.list_jobs(
            state, limit, after=after, older_than=older_than, task=task, entry=entry
        )

    def find_ids(self, prefix: str, limit: int) -> list[JobRef]:
        return self.inner.find_ids(prefix, limit)

    def claim_due(self, limit: int, *, node: str, reason: str = "claimed") -> list[Job]:
        return self.inner.claim_due(limit, node=node, reason=reason)

    def purge_expired(self, limit: int) -> int:
        return self.inner.purge_expired(limit)

    def acquire_lease(self, name: str, token: str, ttl: float) -> bool:
        return self.inner.acquire_lease(name, token, ttl)

    def renew_lease(self, name: str, token: str, ttl: float) -> bool:
        return self.inner.renew_lease(name, token, ttl)

    def release_lease(self, name: str, token: str) -> bool:
        return self.inner.release_lease(name, token)

    def lease(self, name: str) -> tuple[str, datetime] | None:
        return self.inner.lease(name)

    def entries_revision(self) -> int:
        return self.inner.entries_revision()

    def read_entries(self) -> tuple[int, dict[str, str]]:
        """The stored entries, each verified: one that does not is refused by beat, named."""
        revision, found = self.inner.read_entries()
        verify = self.signer.verified_entry
        return revision, {name: verify(name, text) for name, text in found.items()}

    def write_entry(
        self, name: str, definition: str | None, *, expect: str | Unchecked | None = UNCHECKED
    ) -> int | None:
        """The definition signed; ``expect`` is compared with what :meth:`read_entries` gives
        (verified), and the write with the signed text it was read from."""
        signed = None if definition is None else self.signer.sign_entry(name, definition)
        if isinstance(expect, Unchecked):
            return self.inner.write_entry(name, signed)
        raw = self.inner.read_entries()[1].get(name)
        seen = None if raw is None else self.signer.verified_entry(name, raw)
        if seen != expect:
            return None
        return self.inner.write_entry(name, signed, expect=raw)

    def close(self) -> None:
        self.inner.close()

    def partitions(self) -> list[StateStore]:
        """The wrapped store's partitions (itself, for most), each signing what it writes."""
        return [SigningStore(part, self.signer) for part in partitions_of(self.inner)]

    def _signed_new(self, new: NewJob) -> NewJob:
        """``new`` signed, unless its writer signed it already.

        A writer that builds the record it dispatches from its own request (beat,
        whose claims are brief: the store answers with a status only) signs the
        request itself, so that record carries the signature too.
        """
        return new if new.signature is not None else self.signer.sign_new(new)

    def _signed(self, ref: JobRef, request: Transition) -> Transition:
        """``request`` signed over the record it produces, when it changes the payload."""
        if (request.args is None and request.kwargs is None) or request.signature is not None:
            return request
        current = self.inner.get(ref)
        if current is None or not self.signer.verify(current):
            return request  # never re-sign a record that does not verify
        after = dataclasses.replace(
            current,
            args=list(request.args) if request.args is not None else current.args,
            kwargs=dict(request.kwargs) if request.kwargs is not None else current.kwargs,
        )
        return dataclasses.replace(request, signature=self.signer.sign(after))
