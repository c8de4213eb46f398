"""The store contract: what every job store does, atomically.

:class:`StateStore` is a :class:`typing.Protocol`: structural, importing no
driver, so third-party stores and test fakes fit it without inheriting. The
docstrings say what each operation guarantees; the contract suite
(``tests/contract``) holds every store to them, on every backend.

Conventions shared by every operation:

* A store is bound to one namespace; every key or row it touches is under it.
* All ages, due checks and expiries use the store's own clock
  (:meth:`StateStore.now`), never the caller's.
* Driver errors are wrapped: :class:`~celery_exactonce.core.exceptions.StoreUnavailable`
  when retrying may help (connection refused or reset, timeout, lock wait),
  :class:`~celery_exactonce.core.exceptions.StoreError` otherwise. An error raised
  after the request was sent leaves the outcome unknown: settle it by reading
  the record back and asking it (:meth:`celery_exactonce.core.jobs.Job.applied`);
  :mod:`celery_exactonce.stores.settle` does both for every writer.
* Lost races are return values (:class:`~celery_exactonce.core.jobs.CreateStatus`,
  :class:`~celery_exactonce.core.jobs.TransitionStatus`), never exceptions.

A store may also be :class:`Partitioned`: made of parts that are each a whole
store of their own (records, indexes, leases), as the shards of a sharded
Redis Cluster namespace are. :func:`partitions_of` gives any store's parts
(itself, for a store of one part); the reconciler takes its lease on each part
and reconciles the parts it holds, so that several nodes reconcile at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Protocol, runtime_checkable

from celery_exactonce.core import refs
from celery_exactonce.core.jobs import CreateResult, Job, TransitionResult
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.skipped_slots import SkippedSlots
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition

#: Version of the key format / schema this code writes. A store holding a
#: newer version refuses to start (a rolling deploy never mixes formats).
FORMAT_VERSION = 1


class Unchecked:
    """The type of :data:`UNCHECKED`: a write that replaces whatever is there."""


#: ``write_entry(..., expect=UNCHECKED)``: no comparison, the write replaces what is there.
UNCHECKED = Unchecked()


def matches(current: str | None, expect: str | Unchecked | None) -> bool:
    """Whether an entry whose definition is ``current`` (``None``: absent) is as ``expect``."""
    return isinstance(expect, Unchecked) or current == expect


def check_entry_name(name: object) -> str:
    """A stored beat entry's name, checked: 1-255 characters, no control characters.

    Raises :class:`~celery_exactonce.core.exceptions.InvalidPayload` naming the value.
    """
    refs.validate_identifier(name, "entry name", refs.MAX_NAME_LENGTH)
    return str(name)


def format_written(store: object) -> int:
    """The version ``store``'s code writes: its ``format_written`` (the SQL stores' schema
    version, :data:`celery_exactonce.stores.sql.schema.SCHEMA_VERSION`), else
    :data:`FORMAT_VERSION` (the Redis key format, the memory store)."""
    return int(getattr(store, "format_written", FORMAT_VERSION))


#: The most records of skipped slots a namespace keeps (:meth:`StateStore.note_skipped`).
SKIPPED_KEPT = 1000


@dataclasses.dataclass(frozen=True)
class DueBacklog:
    """Delayed jobs due and not yet claimed (:meth:`StateStore.due_backlog`).

    ``count`` ``PENDING`` jobs whose ``run_at`` is at or before ``now`` (the
    store's time they were counted at); ``oldest`` is the earliest of their
    ``run_at`` (``None`` when there is none).
    """

    count: int
    oldest: datetime | None
    now: datetime

    @property
    def oldest_age(self) -> float:
        """Seconds the oldest due job has waited past its ``run_at`` (store time); 0 when none."""
        if self.oldest is None:
            return 0.0
        return max(0.0, (self.now - self.oldest).total_seconds())


#: What a store's ``enqueue`` may run while its write's answer is on the way (the caller's
#: message built), where the store says it can (``enqueue_overlaps``); else it runs first.
Run = Callable[[], None] | None


@runtime_checkable
class StateStore(Protocol):
    """A durable job store for one namespace."""

    @property
    def namespace(self) -> str:
        """The namespace every key or row of this store lives under."""
        ...

    @property
    def retention(self) -> float:
        """Seconds a terminal record is kept, from ``max(fire_time, terminal_at)``."""
        ...

    def now(self) -> datetime:
        """The store's clock (Redis ``TIME``, SQL ``now()``), as an aware UTC datetime."""
        ...

    def setup(self) -> None:
        """Create or upgrade what the store needs (schema, format marker). Idempotent.

        Raises :class:`~celery_exactonce.core.exceptions.SchemaMismatch` when the
        store holds a newer format than this code writes.
        """
        ...

    def schema_version(self) -> int | None:
        """The format version the store holds, ``None`` when it was never set up. Reads only.

        What ``celery exactonce check`` compares with :data:`FORMAT_VERSION`
        without creating anything (:meth:`setup` creates).
        """
        ...

    def epoch(self, *, replace: str | None = None) -> str:
        """The store's epoch, created if absent (atomically: one winner).

        The epoch is a random token written once per store life. A store that
        lost its data (a Redis restart without persistence) no longer holds the
        epoch a node remembers, and :meth:`create` with that epoch reports
        :attr:`~celery_exactonce.core.jobs.CreateStatus.EPOCH_MISMATCH`.

        With ``replace``, a store whose epoch is still ``replace`` (or has none)
        starts a new one, born now: a node that found the store forgot some of
        its writes (which kept the epoch) declares a new life, so every node's
        next claim with the old epoch is refused (a claim already in flight may
        still pass). A store whose epoch already changed keeps it (one winner).
        Either way the current epoch is returned.
        """
        ...

    def create(self, new: NewJob, *, epoch: str | None = None) -> CreateResult:
        """Create a job if no record with ``new.ref`` exists. Atomic, one round trip.

        In the same atomic step:

        * when ``epoch`` is given, the store's epoch must equal it, else
          nothing is written and the status is ``EPOCH_MISMATCH``;
        * for an occurrence, the entry's durable watermark: if a record
          exists the status is ``EXISTS``; if none exists and ``fire_time`` is
          at or below the watermark, nothing is written and the status is
          ``BELOW_WATERMARK``; otherwise the record is created and the
          watermark advanced to ``fire_time``.

        Repeating a call that applied returns ``EXISTS`` with the record, whose
        ``rev`` equals ``new.rev``: that is how a create that timed out is
        settled.
        """
        ...

    def create_many(
        self, news: Sequence[NewJob], *, epoch: str | None = None, brief: bool = False
    ) -> list[CreateResult]:
        """:meth:`create` for each of ``news``, in order, in as few round trips as it can.

        Each create is atomic on its own, with its own result; the batch is not
        (another writer may interleave between two of them). An error raised
        leaves every outcome of the batch unknown: settle each by reading back.
        With ``brief`` the store may leave ``job`` unset in the results (the
        status is enough for the caller, and reading records back costs).
        Beat claims a tick's due slots with it.
        """
        ...

    def get(self, ref: JobRef) -> Job | None:
        """The record, or ``None``."""
        ...

    def transition(self, ref: JobRef, request: Transition) -> TransitionResult:
        """Compare-and-swap: apply ``request`` if all its guards hold. Atomic.

        The guards and effects are those of :class:`~celery_exactonce.core.writes.Transition`
        (:func:`~celery_exactonce.core.jobs.check_transition`, with the lease checked
        in the same atomic step). Terminal records refuse every transition.
        Indexes (state, due, expiry) move with the record.
        """
        ...

    def transition_many(
        self, requests: Sequence[tuple[JobRef, Transition]], *, brief: bool = False
    ) -> list[TransitionResult]:
        """:meth:`transition` for each ``(ref, request)``, in order, in as few round trips.

        Each transition is atomic on its own; the batch is not. An error raised
        leaves every outcome unknown: settle each by reading back its ``new_rev``.
        With ``brief`` the store may leave ``job`` unset in an applied result
        (the caller needs no record back, and reading it back costs); a refused
        one (``CONFLICT``, ``LEASE_LOST``) carries the record as it is all the
        same, for the caller to decide on. The dispatcher's writes, the worker
        gate's CAS and the completion write are brief.
        """
        ...

    def heartbeat(self, ref: JobRef, run_id: str) -> bool:
        """Touch a ``RUNNING`` job owned by ``run_id`` (store time); ``rev`` is unchanged.

        Returns whether the job is ``RUNNING`` under ``run_id`` (and so was touched).
        """
        ...

    def annotate(self, ref: JobRef, *, node: str, reason: str, op_id: str) -> bool:
        """Append a note to the job's history (store time), atomically; nothing else changes.

        For what a job's record should say without a transition: a claim
        conflict, an outcome that came too late. See
        :func:`~celery_exactonce.core.jobs.annotate_job`: state, ``rev`` and
        ``touched_at`` are unchanged, and a repeat with the same ``op_id``
        appends nothing. Returns whether the record exists.
        """
        ...

    def watermark(self, entry: str) -> datetime | None:
        """The highest ``fire_time`` claimed for ``entry``, or ``None``."""
        ...

    def watermarks(self, entries: Sequence[str]) -> dict[str, datetime]:
        """The watermarks of ``entries`` that have one, in one round trip (a few for SQL)."""
        ...

    def note_skipped(self, skipped: Sequence[SkippedSlots]) -> None:
        """Keep a record of each range of skipped slots, stamped with the store time.

        Records are kept for the retention (the memory and Redis stores keep the
        newest :data:`SKIPPED_KEPT` at most); they say what beat did not run,
        for people (the admin, the CLI). Nothing of the protocol reads them.
        """
        ...

    def skipped(self, limit: int = 100) -> list[SkippedSlots]:
        """The newest records of :meth:`note_skipped`, newest first, at most ``limit``."""
        ...

    def entries_revision(self) -> int:
        """The stored beat entries' revision: 0 before the first write, one more per write
        (one cheap read each beat tick: :meth:`read_entries` only when it moved)."""
        ...

    def read_entries(self) -> tuple[int, dict[str, str]]:
        """Every stored beat entry's definition (JSON text) by name, and their revision
        (one snapshot: the revision these definitions are at)."""
        ...

    def write_entry(
        self, name: str, definition: str | None, *, expect: str | Unchecked | None = UNCHECKED
    ) -> int | None:
        """Store ``definition`` as entry ``name``'s (``None`` deletes it); the new revision.

        With ``expect``, only if the entry's definition is that text (``None``:
        there is none), atomically with the write; else nothing is written and
        the answer is ``None`` (a concurrent writer changed it: read again).
        Writes are serialised: each gets its own revision, and a reader that
        saw revision ``n`` sees every write up to ``n``. ``name`` is checked
        with :func:`check_entry_name`. What a definition holds is
        :mod:`celery_exactonce.entries`'s; the store keeps it as given.
        """
        ...

    def count_by_state(self) -> dict[State, int]:
        """How many records of this namespace are in each state (every state, zeros too).

        For gauges and people, not the protocol: one round trip, counted in
        one snapshot, served by the state indexes (SQL: an index-only count).
        """
        ...

    def due_backlog(self) -> DueBacklog:
        """The ``PENDING`` jobs whose ``run_at`` has come (store time): how many, the oldest.

        For gauges and people, not the protocol: served by the due index
        (``(state, run_at)``), so the cost follows the due jobs, not all jobs.
        """
        ...

    def list_stale(
        self,
        state: State,
        older_than: float,
        limit: int,
        *,
        after: tuple[datetime, JobRef] | None = None,
    ) -> list[Job]:
        """Jobs in ``state`` last touched at least ``older_than`` seconds ago (store time).

        In ``(touched_at, str(ref))`` order (oldest first; ties by the ref's
        code points), at most ``limit``, served by an index on
        ``(state, touched_at)``: the cost follows the stale jobs, not all jobs.

        ``after`` is a keyset cursor, the ``(touched_at, ref)`` of the last job
        of the previous page: only jobs strictly after it in that order are
        returned (the job need not exist any more). Paging so walks past a
        head of jobs a caller cannot act on yet (the reconciler's waiting
        backlog) instead of listing the same ones forever; a page shorter than
        ``limit`` means the end was reached.
        """
        ...

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
        """The jobs in ``state``, for people (the CLI): :meth:`list_stale` with filters.

        In ``(touched_at, str(ref))`` order, at most ``limit``, from the keyset
        cursor ``after`` as :meth:`list_stale` pages; only jobs last touched at
        least ``older_than`` seconds ago (store time), of task ``task`` and of
        beat entry ``entry`` when given. A page shorter than ``limit`` means
        the end was reached. A store may filter on the task and the entry
        after reading the records (the Redis store does): the cost then
        follows the jobs in ``state``, not the matches.
        """
        ...

    def find_ids(self, prefix: str, limit: int) -> list[JobRef]:
        """The refs whose id starts with ``prefix``, in either key space, for people (the CLI).

        In ``str(ref)`` code-point order (every ``o:`` ref before every ``t:``
        one), at most ``limit``: a caller asks for one more than it shows to
        learn whether a prefix is ambiguous. ``prefix`` is refused as a job id
        is (empty, over-long, control characters). The cost is bounded by
        ``limit`` on the SQL stores (a range of the primary key per key
        space); the Redis stores walk the state indexes of the namespace with
        ``ZSCAN … MATCH`` until ``limit`` matched, so their cost follows the
        namespace's jobs, never the server's other keys.
        """
        ...

    def claim_due(self, limit: int, *, node: str, reason: str = "claimed") -> list[Job]:
        """Move up to ``limit`` due ``PENDING`` jobs (``run_at <= now``) to ``SCHEDULED``.

        In ``run_at`` order; safe with many concurrent claimers (each job is
        returned by exactly one call); every claimed job gets a new ``rev``.
        """
        ...

    def purge_expired(self, limit: int) -> int:
        """Delete up to ``limit`` terminal records past the retention; return how many.

        Only terminal records ever expire; live ones are kept however old.
        """
        ...

    def acquire_lease(self, name: str, token: str, ttl: float) -> bool:
        """Take lease ``name`` for ``ttl`` seconds if it is free or expired. Atomic.

        Re-acquiring a lease already held with the same token renews it.
        """
        ...

    def renew_lease(self, name: str, token: str, ttl: float) -> bool:
        """Extend lease ``name`` by ``ttl`` seconds if it is still held with ``token``."""
        ...

    def release_lease(self, name: str, token: str) -> bool:
        """Release lease ``name`` if it is held with ``token``; a stale token releases nothing."""
        ...

    def lease(self, name: str) -> tuple[str, datetime] | None:
        """The token holding lease ``name`` and when it expires (store time); ``None`` if free.

        A read for people (the CLI): the holder may change right after it.
        """
        ...

    def close(self) -> None:
        """Release connections. The store may not be used afterwards."""
        ...


@runtime_checkable
class Partitioned(Protocol):
    """A store made of parts, each a whole :class:`StateStore` with its own leases.

    Every record lives in exactly one part, and a write through the whole
    store reaches that part: so a transition guarded by a lease taken on a
    part is checked where the record lives, when the record was found there.
    """

    def partitions(self) -> Sequence[StateStore]:
        """The parts, always in the same order, each on its own keys (two never share one)."""
        ...


def partitions_of(store: StateStore) -> Sequence[StateStore]:
    """The parts of ``store`` (:class:`Partitioned`); a store of one part is its own."""
    if isinstance(store, Partitioned):
        return store.partitions()
    return [store]
