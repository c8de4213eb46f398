"""InMemoryStore: the job store in a Python dict, for tests and single-process use.

Public and thread-safe (one lock around every operation, which is what makes
each operation atomic). It keeps nothing across processes or restarts, so it
is for unit tests, examples and users testing their own code; it implements
the whole contract and passes the same contract suite as the real stores.

The clock is injectable (:class:`~celery_exactonce.testing.FrozenClock`), so
tests can move store time without sleeping.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Sequence
from datetime import datetime, timedelta

from celery_exactonce.core import exceptions, jobs, refs, times
from celery_exactonce.core.clock import Clock, SystemClock
from celery_exactonce.core.jobs import (
    CreateResult,
    CreateStatus,
    Job,
    TransitionResult,
    TransitionStatus,
)
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.skipped_slots import SkippedSlots
from celery_exactonce.core.states import TERMINAL, State
from celery_exactonce.core.writes import Lease, NewJob, Transition
from celery_exactonce.stores.base import (
    FORMAT_VERSION,
    SKIPPED_KEPT,
    UNCHECKED,
    DueBacklog,
    Unchecked,
    check_entry_name,
    matches,
)


class InMemoryStore:
    """A thread-safe, in-process :class:`~celery_exactonce.stores.base.StateStore`."""

    def __init__(
        self,
        namespace: str = "default",
        *,
        retention: float = 7 * 86_400,
        clock: Clock | None = None,
        compaction: jobs.Compaction = jobs.KEEP,
    ) -> None:
        refs.validate_identifier(namespace, "namespace", refs.MAX_NAME_LENGTH)
        if retention <= 0:
            raise exceptions.ConfigurationError(
                "exactonce_retention must be > 0", setting="exactonce_retention"
            )
        self._namespace = namespace
        self._retention = float(retention)
        self._clock = clock or SystemClock()
        self._compaction = compaction
        self._lock = threading.RLock()
        self._closed = False
        self._reset()

    def _reset(self) -> None:
        self._jobs: dict[JobRef, Job] = {}
        self._by_state: dict[State, set[JobRef]] = {state: set() for state in State}
        self._watermarks: dict[str, datetime] = {}
        self._unique: dict[str, JobRef] = {}  # a unique key's last job
        self._leases: dict[str, tuple[str, datetime]] = {}
        self._epoch: str | None = None
        self._skipped: collections.deque[SkippedSlots] = collections.deque(maxlen=SKIPPED_KEPT)
        self._entries: dict[str, str] = {}
        self._entries_revision = 0

    # -- properties ------------------------------------------------------------------

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def retention(self) -> float:
        return self._retention

    def now(self) -> datetime:
        self._check_open()
        return times.from_micros(times.to_micros(self._clock.now()))

    def setup(self) -> None:
        self._check_open()

    def schema_version(self) -> int | None:
        self._check_open()
        return FORMAT_VERSION

    def simulate_loss(self, *, keep_epoch: bool = False) -> None:
        """Forget everything, as a Redis restart without persistence would.

        With ``keep_epoch``, the epoch survives: a failover to a replica that
        lags behind (it has the old epoch but not the latest records).
        """
        with self._lock:
            epoch = self._epoch
            self._reset()
            if keep_epoch:
                self._epoch = epoch

    # -- epoch and create ----------------------------------------------------------------

    def epoch(self, *, replace: str | None = None) -> str:
        with self._lock:
            self._check_open()
            if self._epoch is None or (replace is not None and self._epoch == replace):
                born = times.to_micros(self._clock.now())
                self._epoch = f"{refs.new_token()}{refs.EPOCH_SEPARATOR}{born}"
            return self._epoch

    def create(self, new: NewJob, *, epoch: str | None = None) -> CreateResult:
        with self._lock:
            self._check_open()
            if epoch is not None and self._epoch != epoch:
                return CreateResult(CreateStatus.EPOCH_MISMATCH, epoch=self._epoch)
            existing = self._jobs.get(new.ref)
            if existing is not None:
                return CreateResult(CreateStatus.EXISTS, existing, epoch=self._epoch)
            if new.entry is not None and new.fire_time is not None:
                mark = self._watermarks.get(new.entry)
                if mark is not None and new.fire_time <= mark:
                    return CreateResult(CreateStatus.BELOW_WATERMARK, epoch=self._epoch)
                self._watermarks[new.entry] = new.fire_time
            job = jobs.job_from_new(new, self.now())
            self._store(None, job)
            return CreateResult(CreateStatus.CREATED, job, epoch=self._epoch)

    def create_many(
        self, news: Sequence[NewJob], *, epoch: str | None = None, brief: bool = False
    ) -> list[CreateResult]:
        return [self.create(new, epoch=epoch) for new in news]

    def create_unique(self, new: NewJob) -> CreateResult:
        key = new.unique
        if key is None:
            raise exceptions.InvalidRequest(f"job {new.ref}: a unique create needs a key")
        with self._lock:
            self._check_open()
            holder = self._jobs.get(self._unique.get(key, new.ref))  # (its own ref: EXISTS)
            if holder is not None and new.ref not in self._jobs and not holder.state.terminal:
                return CreateResult(CreateStatus.UNIQUE_HELD, holder, epoch=self._epoch)
            result = self.create(new)
            if result.created:
                self._unique[key] = new.ref
            return result

    def get(self, ref: JobRef) -> Job | None:
        with self._lock:
            self._check_open()
            return self._jobs.get(ref)

    # -- transitions ---------------------------------------------------------------------

    def transition(self, ref: JobRef, request: Transition) -> TransitionResult:
        with self._lock:
            self._check_open()
            job = self._jobs.get(ref)
            if job is None:
                return TransitionResult(TransitionStatus.NOT_FOUND)
            now = self.now()
            if request.lease is not None and not self._holds(
                request.lease.name, request.lease.token, now
            ):
                return TransitionResult(TransitionStatus.LEASE_LOST, job)
            if not jobs.check_transition(job, request, now):
                return TransitionResult(TransitionStatus.CONFLICT, job)
            updated = jobs.apply_transition(job, request, now, self._compaction)
            self._store(job, updated)
            return TransitionResult(TransitionStatus.APPLIED, updated)

    def transition_many(
        self, requests: Sequence[tuple[JobRef, Transition]], *, brief: bool = False
    ) -> list[TransitionResult]:
        return [self.transition(ref, request) for ref, request in requests]

    def heartbeat(self, ref: JobRef, run_id: str) -> bool:
        with self._lock:
            self._check_open()
            job = self._jobs.get(ref)
            if job is None or job.state is not State.RUNNING or job.run_id != run_id:
                return False
            now = self.now()
            self._jobs[ref] = dataclasses.replace(job, touched_at=now, heartbeat_at=now)
            return True

    def annotate(self, ref: JobRef, *, node: str, reason: str, op_id: str) -> bool:
        reason = jobs.check_note(node, reason, op_id)
        with self._lock:
            self._check_open()
            job = self._jobs.get(ref)
            if job is None:
                return False
            self._jobs[ref] = jobs.annotate_job(
                job, node=node, reason=reason, op_id=op_id, now=self.now()
            )
            return True

    def watermark(self, entry: str) -> datetime | None:
        return self.watermarks([entry]).get(entry)

    def watermarks(self, entries: Sequence[str]) -> dict[str, datetime]:
        with self._lock:
            self._check_open()
            return {e: self._watermarks[e] for e in entries if e in self._watermarks}

    # -- queries and sweeps --------------------------------------------------------------

    def note_skipped(self, skipped: Sequence[SkippedSlots]) -> None:
        with self._lock:
            self._check_open()
            at = self.now()
            self._skipped.extend(dataclasses.replace(record, at=at) for record in skipped)

    def skipped(self, limit: int = 100) -> list[SkippedSlots]:
        with self._lock:
            self._check_open()
            cutoff = self.now() - timedelta(seconds=self._retention)
            kept = [r for r in reversed(self._skipped) if r.at is not None and r.at >= cutoff]
            return kept[: max(0, limit)]

    def count_by_state(self) -> dict[State, int]:
        with self._lock:
            self._check_open()
            return {state: len(refs_) for state, refs_ in self._by_state.items()}

    def due_backlog(self) -> DueBacklog:
        with self._lock:
            self._check_open()
            now = self.now()
            due = [
                run_at
                for ref in self._by_state[State.PENDING]
                if (run_at := self._jobs[ref].run_at) is not None and run_at <= now
            ]
            return DueBacklog(len(due), min(due, default=None), now)

    def list_stale(
        self,
        state: State,
        older_than: float,
        limit: int,
        *,
        after: tuple[datetime, JobRef] | None = None,
    ) -> list[Job]:
        with self._lock:
            self._check_open()
            cutoff = self.now() - timedelta(seconds=older_than)
            start = None if after is None else (after[0], str(after[1]))
            stale = [
                job
                for job in (self._jobs[ref] for ref in self._by_state[State(state)])
                if job.touched_at <= cutoff
                and (start is None or (job.touched_at, str(job.ref)) > start)
            ]
            stale.sort(key=lambda job: (job.touched_at, str(job.ref)))
            return stale[: max(limit, 0)]

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
        with self._lock:
            every = len(self._by_state[State(state)])
            listed = self.list_stale(state, older_than, every, after=after)
        found = [
            job
            for job in listed
            if (task is None or job.task == task) and (entry is None or job.entry == entry)
        ]
        return found[: max(limit, 0)]

    def find_ids(self, prefix: str, limit: int) -> list[JobRef]:
        refs.validate_identifier(prefix, "job id prefix", refs.MAX_ID_LENGTH)
        with self._lock:
            self._check_open()
            found = sorted((r for r in self._jobs if r.id.startswith(prefix)), key=str)
        return found[: max(limit, 0)]

    def claim_due(self, limit: int, *, node: str, reason: str = "claimed") -> list[Job]:
        with self._lock:
            self._check_open()
            now = self.now()
            due = [
                job
                for job in (self._jobs[ref] for ref in self._by_state[State.PENDING])
                if job.run_at is not None and job.run_at <= now
            ]
            due.sort(key=lambda job: (job.run_at or now, job.ref))
            claimed = []
            for job in due[: max(limit, 0)]:
                request = Transition(
                    State.SCHEDULED, frozenset({State.PENDING}), node=node, reason=reason
                )
                updated = jobs.apply_transition(job, request, now, self._compaction)
                self._store(job, updated)
                claimed.append(updated)
            return claimed

    def purge_expired(self, limit: int) -> int:
        with self._lock:
            self._check_open()
            now = self.now()
            expired = [
                job
                for state in TERMINAL
                for job in (self._jobs[ref] for ref in self._by_state[state])
                if (at := job.expires_at(self._compaction.retention_of(job.ref, self._retention)))
                is not None
                and at <= now
            ]
            expired.sort(
                key=lambda job: (
                    job.expires_at(self._compaction.retention_of(job.ref, self._retention)) or now
                )
            )
            for job in expired[: max(limit, 0)]:
                del self._jobs[job.ref]
                self._by_state[job.state].discard(job.ref)
            return min(len(expired), max(limit, 0))

    # -- stored beat entries -------------------------------------------------------------

    def entries_revision(self) -> int:
        with self._lock:
            self._check_open()
            return self._entries_revision

    def read_entries(self) -> tuple[int, dict[str, str]]:
        with self._lock:
            self._check_open()
            return self._entries_revision, dict(self._entries)

    def write_entry(
        self, name: str, definition: str | None, *, expect: str | Unchecked | None = UNCHECKED
    ) -> int | None:
        check_entry_name(name)
        with self._lock:
            self._check_open()
            if not matches(self._entries.get(name), expect):
                return None
            if definition is None:
                self._entries.pop(name, None)
            else:
                self._entries[name] = definition
            self._entries_revision += 1
            return self._entries_revision

    # -- leases --------------------------------------------------------------------------

    def acquire_lease(self, name: str, token: str, ttl: float) -> bool:
        Lease(name, token)  # validates
        with self._lock:
            self._check_open()
            now = self.now()
            held = self._leases.get(name)
            if held is not None and held[1] > now and held[0] != token:
                return False
            self._leases[name] = (token, now + timedelta(seconds=ttl))
            return True

    def renew_lease(self, name: str, token: str, ttl: float) -> bool:
        with self._lock:
            self._check_open()
            now = self.now()
            if not self._holds(name, token, now):
                return False
            self._leases[name] = (token, now + timedelta(seconds=ttl))
            return True

    def release_lease(self, name: str, token: str) -> bool:
        with self._lock:
            self._check_open()
            if not self._holds(name, token, self.now()):
                return False
            del self._leases[name]
            return True

    def lease(self, name: str) -> tuple[str, datetime] | None:
        with self._lock:
            self._check_open()
            held = self._leases.get(name)
            return held if held is not None and held[1] > self.now() else None

    def close(self) -> None:
        self._closed = True

    # -- internals -----------------------------------------------------------------------

    def _holds(self, name: str, token: str, now: datetime) -> bool:
        held = self._leases.get(name)
        return held is not None and held[0] == token and held[1] > now

    def _store(self, old: Job | None, new: Job) -> None:
        if old is not None:
            self._by_state[old.state].discard(old.ref)
        self._jobs[new.ref] = new
        self._by_state[new.state].add(new.ref)

    def _check_open(self) -> None:
        if self._closed:
            raise exceptions.StoreError("the store is closed")
