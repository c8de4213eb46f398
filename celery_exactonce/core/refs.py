"""Who a job is, the tokens that name writes, and what we accept as a name or a text.

Here: :class:`JobRef`, a job's identity (its key :class:`Space` and its id);
:func:`new_token`, the random tokens that name writes, runs, leases and store
lives, and the birth time a store writes into its epoch (:func:`epoch_born`);
:func:`process_id`, the process whatever is kept per process belongs to;
the length limits every stored name is held to, :func:`validate_identifier`,
which refuses a bad task name, job id, entry key, node id or rev, and
:func:`sanitize_text`, which makes free text (reasons) storable on every
backend.

Not here: the job record (:mod:`celery_exactonce.core.jobs`), the requests that
carry these names (:class:`~celery_exactonce.core.writes.NewJob`,
:class:`~celery_exactonce.core.writes.Transition`), payloads (args, kwargs, options)
and their size limit (:mod:`celery_exactonce.core.payload`), idempotency keys
(:mod:`celery_exactonce.core.keys`).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
from datetime import datetime

from celery_exactonce.core import exceptions
from celery_exactonce.core.times import from_micros

#: Longest task name, job id, entry key, node id or reason we store. Celery ids
#: are 36-character UUIDs; entry names are short. Anything longer is a bug or
#: an attack on the indexes.
MAX_ID_LENGTH = 200
MAX_NAME_LENGTH = 255
MAX_REASON_LENGTH = 500


def new_token() -> str:
    """A globally unique token (revs, run ids, lease tokens, op ids): 128 random bits, in hex."""
    return os.urandom(16).hex()


_pid = os.getpid()


def process_id() -> int:
    """This process's id, as ``os.getpid()`` says it, without asking the kernel each time.

    Whatever a process keeps per process (its runtime, kept connections, a
    worker's in-flight runs) is checked against it on hot paths, every submit
    and every gate write: a forked child sees its own id from the fork on
    (``os.register_at_fork``), and starts afresh.
    """
    return _pid


def _forked() -> None:
    global _pid  # noqa: PLW0603  (one per process)
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


#: Separates an epoch's random part from its birth time (store clock, microseconds).
EPOCH_SEPARATOR = "@"
#: Between the shards' epochs in a sharded store's epoch (celery_exactonce.stores.redis.sharded).
EPOCHS_SEPARATOR = ","
#: A part of a sharded epoch that is no shard's epoch: a claim carrying it is refused on
#: that shard, and an ``epoch(replace=...)`` carrying it leaves that shard's epoch as it is.
NO_EPOCH = "-"


def epoch_born(epoch: str | None) -> datetime | None:
    """When the store created ``epoch`` (its own clock), or ``None`` if the token has no time.

    Stores write epochs as ``<token>@<microseconds>``. No slot whose fire time
    is before a store's birth can have been claimed in that store's life;
    slots before it may have been claimed in a life the store forgot.
    """
    if epoch is None:
        return None
    if EPOCHS_SEPARATOR in epoch:  # a sharded store's: the newest shard's birth
        births = [epoch_born(part) for part in epoch.split(EPOCHS_SEPARATOR)]
        known = [born for born in births if born is not None]
        return max(known) if len(known) == len(births) else None
    if EPOCH_SEPARATOR not in epoch:
        return None
    born = epoch.rpartition(EPOCH_SEPARATOR)[2]
    return from_micros(int(born)) if born.isdigit() else None


class Space(str, enum.Enum):
    """The key space of a job id.

    Beat occurrences and caller-chosen ids never share a key space, so a
    guessed ``task_id`` can never pre-empt a beat slot (docs/design/protocol.md, "Jobs").
    """

    OCCURRENCE = "o"
    SUBMITTED = "t"
    """A job submitted under a Celery ``task_id`` (chosen by the caller, or generated)."""

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True, order=True)
class JobRef:
    """The identity of a job: its key space and its id (the Celery ``task_id``).

    ``entry_hint`` is no part of the identity (equality, order and hash leave it
    out): the entry key a beat occurrence's message names, which tells a sharded
    store where to look first (:mod:`~celery_exactonce.stores.redis.sharded`).
    Only a hint, which a header may get wrong: a store checks it by what it
    finds. Kept on an ``o:`` ref only, and only if it is a valid entry key; any
    other is dropped.
    """

    space: Space
    id: str
    entry_hint: str | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.space, Space):
            object.__setattr__(self, "space", Space(self.space))
        validate_identifier(self.id, "job id", MAX_ID_LENGTH)
        if self.entry_hint is not None and not _valid_hint(self.space, self.entry_hint):
            object.__setattr__(self, "entry_hint", None)

    @classmethod
    def submitted(cls, task_id: str) -> JobRef:
        """The job submitted under ``task_id`` (caller-chosen or generated).

        Not a task name: ``Job.task`` is that. The key space is ``t`` in stored keys.
        """
        return cls(Space.SUBMITTED, task_id)

    @classmethod
    def occurrence(cls, job_id: str, entry_hint: str | None = None) -> JobRef:
        """A beat occurrence's job id; ``entry_hint``: the entry its message names, if any."""
        return cls(Space.OCCURRENCE, job_id, entry_hint)

    def __str__(self) -> str:
        return f"{self.space.value}:{self.id}"

    @classmethod
    def parse(cls, text: str) -> JobRef:
        """Inverse of ``str(ref)``."""
        space, sep, job_id = text.partition(":")
        if not sep:
            raise exceptions.InvalidPayload(f"not a job reference: {text!r}")
        return cls(Space(space), job_id)


_CONTROL = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")
#: What not every backend stores in a text column: NUL and the other C0 controls but
#: tab, newline and carriage return, DEL, and lone surrogates (a non-UTF-8 file name
#: decoded with surrogateescape).
_UNSTORABLE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]")


def validate_identifier(value: object, what: str, max_length: int) -> None:
    """Refuse empty, over-long or control-character identifiers, naming ``what``."""
    if not isinstance(value, str):
        raise exceptions.InvalidPayload(f"{what} must be a string, got {type(value).__name__}")
    if not value:
        raise exceptions.InvalidPayload(f"{what} must not be empty")
    if len(value) > max_length:
        raise exceptions.InvalidPayload(f"{what} {value[:40]!r}… is over {max_length} characters")
    if _CONTROL.search(value):
        raise exceptions.InvalidPayload(
            f"{what} {value!r} contains control characters or lone surrogates"
        )


def _valid_hint(space: Space, hint: object) -> bool:
    """Whether ``hint`` may route a ref of ``space``: an occurrence's, and a valid entry key."""
    if space is not Space.OCCURRENCE:
        return False
    try:
        validate_identifier(hint, "entry key", MAX_NAME_LENGTH)
    except exceptions.InvalidPayload:
        return False
    return True


def validate_reason(reason: object) -> None:
    if not isinstance(reason, str):
        raise exceptions.InvalidPayload(f"reason must be a string, got {type(reason).__name__}")


def sanitize_text(text: str, max_length: int = MAX_REASON_LENGTH) -> str:
    """``text`` as every store can hold it: unstorable characters replaced, length capped.

    NUL and the other control characters but tab, newline and carriage return, and lone
    surrogates, become U+FFFD; text over ``max_length`` characters is cut and
    ends with an ellipsis. Used for every reason written to a record, so a
    completion whose exception message holds such characters is still recorded.
    """
    clean = _UNSTORABLE.sub("\ufffd", text)
    if len(clean) > max_length:
        clean = clean[: max_length - 1] + "…"
    return clean
