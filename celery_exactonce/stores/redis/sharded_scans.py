"""The sharded Redis store's scans, partitions and leases: what goes over every shard.

A base of :class:`~celery_exactonce.stores.redis.sharded.ShardedRedisStore`
(which says how a namespace is sharded): counts are summed, ``list_stale``
pages merged in ``(touched_at, ref)`` order (each shard answers its first
``limit`` past the cursor, so the first ``limit`` of the merge are the
namespace's), ``claim_due`` reads the head of each shard's ``due`` first, so
that the jobs come in ``run_at`` order across the shards (one read per shard
more than on one slot).

The shards are the store's partitions
(:class:`~celery_exactonce.stores.base.Partitioned`): each is a
:class:`Shard`, a whole one-slot store, with its own lease keys. The
reconciler takes its lease on each shard and reconciles the shards it holds.
The store's own lease methods take a lease on every shard at once (all or
none), for a caller that sees the namespace as one store.
Every record the store reads, and every record a shard lists, teaches the
store which shard an ``o:`` ref lives on.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any

from celery_exactonce.core import refs
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef, Space
from celery_exactonce.core.skipped_slots import SkippedSlots
from celery_exactonce.core.states import State
from celery_exactonce.stores.base import UNCHECKED, DueBacklog, Unchecked
from celery_exactonce.stores.redis.store import RedisStore

#: How many ``o:`` refs' shards a store remembers (the oldest forgotten first).
KNOWN_REFS = 65_536


class Shard(RedisStore):
    """Shard ``index`` of a sharded namespace: a whole store on one slot.

    What it lists (``list_stale``, which ``list_jobs`` pages through) teaches
    ``owner`` (the sharded store) where each ``o:`` ref lives, so that a write
    through the sharded store goes straight to it.
    """

    def __init__(self, client: Any, *, owner: ShardedScans, index: int, **options: Any) -> None:
        super().__init__(client, shard=index, **options)
        self._owner = owner
        self.index = index

    def __repr__(self) -> str:
        return f"Shard({self._where}, namespace={self._namespace!r}, shard={self.index})"

    def list_stale(self, state: State, older_than: float, limit: int, **options: Any) -> list[Job]:
        found = super().list_stale(state, older_than, limit, **options)
        self._owner._learn(self.index, found)
        return found


class ShardedScans:
    """Scans, counts and leases over ``_parts``, the shards' stores (shard ``s`` at ``s``)."""

    _parts: list[Shard]
    _n: int
    _known: collections.OrderedDict[JobRef, int]
    _lock: threading.Lock

    @property
    def shards(self) -> int:
        """``exactonce_shards``."""
        return self._n

    def _remember(self, ref: JobRef, shard: int) -> None:
        if ref.space is not Space.OCCURRENCE:
            return
        with self._lock:
            self._known[ref] = shard
            self._known.move_to_end(ref)
            while len(self._known) > KNOWN_REFS:
                self._known.popitem(last=False)

    def _learn(self, shard: int, found: Iterable[Job | None]) -> None:
        for job in found:
            if job is not None:
                self._remember(job.ref, shard)

    def skipped(self, limit: int = 100) -> list[SkippedSlots]:
        found = [r for part in self._parts for r in part.skipped(limit) if r.at is not None]
        found.sort(key=lambda r: r.at or datetime.min, reverse=True)  # newest first, as one
        return found[: max(limit, 0)]

    # -- queries and sweeps ------------------------------------------------------------------

    def count_by_state(self) -> dict[State, int]:
        counts = dict.fromkeys(State, 0)
        for part in self._parts:
            for state, n in part.count_by_state().items():
                counts[state] += n
        return counts

    def due_backlog(self) -> DueBacklog:
        backlogs = [part.due_backlog() for part in self._parts]
        oldest = [b.oldest for b in backlogs if b.oldest is not None]
        return DueBacklog(
            count=sum(b.count for b in backlogs),
            oldest=min(oldest) if oldest else None,
            now=max(b.now for b in backlogs),
        )

    def partitions(self) -> Sequence[Shard]:
        """The shards, in shard order (:class:`~celery_exactonce.stores.base.Partitioned`)."""
        return list(self._parts)

    def _merged(self, shard_pages: Callable[[Shard], list[Job]], limit: int) -> list[Job]:
        jobs: list[Job] = []
        for part in self._parts:
            jobs.extend(shard_pages(part))  # each shard learns what it lists
        jobs.sort(key=lambda job: (job.touched_at, str(job.ref).encode()))
        return jobs[: max(limit, 0)]

    def list_stale(
        self,
        state: State,
        older_than: float,
        limit: int,
        *,
        after: tuple[datetime, JobRef] | None = None,
    ) -> list[Job]:
        return self._merged(lambda p: p.list_stale(state, older_than, limit, after=after), limit)

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
        options: dict[str, Any] = {"after": after, "older_than": older_than}
        options.update(task=task, entry=entry)
        return self._merged(lambda p: p.list_jobs(state, limit, **options), limit)

    def find_ids(self, prefix: str, limit: int) -> list[JobRef]:
        """Each shard's first ``limit`` refs, merged: the namespace's first ``limit``."""
        found: list[JobRef] = []
        for shard, part in enumerate(self._parts):
            for ref in part.find_ids(prefix, limit):
                self._remember(ref, shard)
                found.append(ref)
        return sorted(set(found), key=str)[: max(limit, 0)]

    def claim_due(self, limit: int, *, node: str, reason: str = "claimed") -> list[Job]:
        refs.validate_identifier(node, "node id", refs.MAX_NAME_LENGTH)
        refs.validate_reason(reason)
        if limit <= 0:
            return []
        # The first ``limit`` of the shards' due heads, merged by run_at, say how many each
        # shard gives: the due jobs come in run_at order across the shards, as on one slot.
        heads: list[tuple[float, int]] = []
        for shard, part in enumerate(self._parts):
            with part._wrap("claim_due"):
                head = part._client.zrange(part._due_key, 0, limit - 1, withscores=True)
            heads.extend((float(item[1]), shard) for item in head)
        wanted = collections.Counter(shard for _, shard in sorted(heads)[:limit])
        claimed: list[Job] = []
        for shard, count in sorted(wanted.items()):
            got = self._parts[shard].claim_due(count, node=node, reason=reason)
            self._learn(shard, got)
            claimed.extend(got)
        claimed.sort(key=lambda job: (job.run_at or job.touched_at, str(job.ref)))
        return claimed

    def purge_expired(self, limit: int) -> int:
        purged = 0
        for part in self._parts:
            if purged >= limit:
                break
            purged += part.purge_expired(limit - purged)
        return purged

    # -- stored beat entries: on the first shard, which every node reads ----------------

    def entries_revision(self) -> int:
        return self._parts[0].entries_revision()

    def read_entries(self) -> tuple[int, dict[str, str]]:
        return self._parts[0].read_entries()

    def write_entry(
        self, name: str, definition: str | None, *, expect: str | Unchecked | None = UNCHECKED
    ) -> int | None:
        return self._parts[0].write_entry(name, definition, expect=expect)

    # -- the namespace's lease: held on every shard, as a transition checks its shard's ------

    def acquire_lease(self, name: str, token: str, ttl: float) -> bool:
        """Take the lease on every shard, in shard order (so two takers meet at the first).

        A shard refusing (another holder, of this lease or of that shard's
        alone) releases what was taken, and nothing is held.
        """
        taken: list[Shard] = []
        try:
            for part in self._parts:
                if not part.acquire_lease(name, token, ttl):
                    break
                taken.append(part)
        finally:
            if len(taken) < self._n:
                for part in taken:
                    part.release_lease(name, token)
        return len(taken) == self._n

    def renew_lease(self, name: str, token: str, ttl: float) -> bool:
        renewed = [part.renew_lease(name, token, ttl) for part in self._parts]
        return all(renewed)

    def lease(self, name: str) -> tuple[str, datetime] | None:
        """The holder of the first shard whose lease ``name`` is held (``None``: none is)."""
        for part in self._parts:
            held = part.lease(name)
            if held is not None:
                return held
        return None

    def release_lease(self, name: str, token: str) -> bool:
        released = [part.release_lease(name, token) for part in self._parts]
        return released[0]  # shard 0's answers, as it is the one taken first
