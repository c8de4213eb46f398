"""The Redis store of a namespace spread over ``exactonce_shards`` slots of a Redis Cluster.

:class:`ShardedRedisStore` holds one
:class:`~celery_exactonce.stores.redis.sharded_scans.Shard` (a
:class:`~celery_exactonce.stores.redis.store.RedisStore`) per shard, all on one
cluster client, each under its own hash tag
(:mod:`~celery_exactonce.stores.shards`): each shard has every key of the
one-slot layout (records, indexes, ``due``, ``wm``, ``epoch``, leases,
``meta``), so every script still touches one slot. This class only routes:

* **Which shard.** A beat occurrence (an ``o:`` job with an entry) lives on
  its entry's shard, with the entry's watermark: the claim checks the epoch,
  creates the record and raises the watermark in one script. Any other job
  lives on the shard of ``str(ref)``. A ``t:`` ref is so found from itself
  alone (the submit and the gate pay no extra round trip); an ``o:`` ref
  does not name its entry, so its shard is remembered from every create and
  every record read (a record never moves: its id fixes its entry). One the
  store does not know goes by its ref's ``entry_hint``, the entry its
  message names (``exactonce_key``): a worker's gate, heartbeats and
  completion write there at once, unread. The hint is only a hint (a header
  may be wrong or forged): an answer there that says "no such record" sends
  the call on to the shard a search finds the record on (no write applies
  where the record is not). A read, or a ref with no hint, searches: each
  shard in turn (the hinted one first), until one holds it.
* **The epoch.** :meth:`epoch` is every shard's epoch joined by ``,`` in
  shard order; a claim carries it and each shard checks its own part. A
  mismatch on any shard refuses that shard's claims; the node then adopts the
  whole new list, and its store-loss guard
  (:mod:`~celery_exactonce.beat.store_loss`) holds a floor per shard from each
  part's birth, so only the lost shard's entries are held back. A
  replacement replaces each shard whose current part it names (a part
  given as no epoch leaves that shard's alone).
* **Scans** (``claim_due``, ``purge_expired``, ``list_stale``, counts,
  skipped slots) go over every shard
  (:mod:`~celery_exactonce.stores.redis.sharded_scans`): ``claim_due`` in
  ``run_at`` order across the shards, pages of ``list_stale`` merged in
  ``(touched_at, ref)`` order.
* **Leases.** The shards are the store's partitions (:meth:`partitions`,
  :class:`~celery_exactonce.stores.base.Partitioned`): the reconciler takes
  its lease on each shard on its own and reconciles the shards it holds, so
  several nodes reconcile at once, each on shards the others do not hold. A
  transition guarded by a shard's lease checks it on that shard, where the
  record the reconciler listed there lives. The store's own lease methods
  take a lease on every shard at once (in shard order, all or none), for a
  caller that sees the namespace as one store; such a holder and a shard's
  holder exclude each other.
* **Replicas** (``exactonce_min_replicas``): each shard's writes wait for the
  replicas of that shard's master; start-up checks every shard's master.

``exactonce_shards`` is pinned: each shard's ``meta`` holds it and the
one-slot ``meta`` (``{prefix}:{<namespace>}:meta``) holds it too, so a node
with another value, one shard included, is refused at start-up.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from celery_exactonce.core import exceptions, jobs
from celery_exactonce.core.jobs import (
    CreateResult,
    CreateStatus,
    Job,
    TransitionResult,
)
from celery_exactonce.core.refs import EPOCHS_SEPARATOR, NO_EPOCH, JobRef
from celery_exactonce.core.skipped_slots import SkippedSlots
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.stores import redact_url, url_secrets
from celery_exactonce.stores.redis.client import client_from_url
from celery_exactonce.stores.redis.codec import as_text
from celery_exactonce.stores.redis.keys import key_base
from celery_exactonce.stores.redis.sharded_routes import ShardRoutes, found
from celery_exactonce.stores.redis.sharded_scans import Shard
from celery_exactonce.stores.redis.store import RedisStore
from celery_exactonce.stores.shards import pinned_elsewhere, shard_of


class ShardedRedisStore(ShardRoutes):
    """A :class:`~celery_exactonce.stores.base.StateStore` over ``shards`` Redis Cluster slots."""

    def __init__(
        self,
        client: Any,
        *,
        namespace: str,
        retention: float,
        shards: int,
        prefix: str = "exactonce",
        min_replicas: int = 0,
        replica_timeout: float = 5.0,
        compaction: jobs.Compaction = jobs.KEEP,
    ) -> None:
        if shards < 2:
            raise exceptions.ConfigurationError(
                f"exactonce_shards={shards}: a sharded store has 2 or more",
                setting="exactonce_shards",
            )
        self._parts = [
            Shard(
                client,
                owner=self,
                index=s,
                namespace=namespace,
                retention=retention,
                prefix=prefix,
                min_replicas=min_replicas,
                replica_timeout=replica_timeout,
                shards=shards,
                compaction=compaction,
            )
            for s in range(shards)
        ]
        self._n = shards
        self._marker = f"{key_base(prefix, namespace)}:meta"
        self._known: collections.OrderedDict[JobRef, int] = collections.OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        namespace: str,
        retention: float,
        shards: int,
        prefix: str = "exactonce",
        socket_timeout: float = 5.0,
        min_replicas: int = 0,
        compaction: jobs.Compaction = jobs.KEEP,
        **kwargs: Any,
    ) -> ShardedRedisStore:
        """A store on a new cluster client for ``url`` (``redis+cluster://``).

        With ``min_replicas`` ≥ 1 each shard's counted writes wait for the
        replicas of that shard's master (the socket waits twice ``socket_timeout``).
        """
        store = cls(
            client_from_url(url, socket_timeout, kwargs, min_replicas=min_replicas),
            namespace=namespace,
            retention=retention,
            shards=shards,
            prefix=prefix,
            min_replicas=min_replicas,
            replica_timeout=socket_timeout,
            compaction=compaction,
        )
        store._parts[0]._owns_client = True  # the shards share it: the first closes it
        for part in store._parts:
            part._where = redact_url(url)
            part._secrets += url_secrets(url)
        return store

    def __repr__(self) -> str:
        return f"ShardedRedisStore({self._parts[0]._where}, shards={self._n})"

    def _split_epoch(self, epoch: str | None) -> list[str | None]:
        if epoch is None:
            return [None] * self._n
        parts = epoch.split(EPOCHS_SEPARATOR)
        if len(parts) != self._n:  # another layout's epoch: every shard refuses it
            return [epoch] * self._n
        # An empty part (a shard that had none) must not read as "no epoch held": the
        # script would skip the check. NO_EPOCH is no epoch, so that shard refuses (fail
        # closed), and a replacement leaves its epoch as it is.
        return [part or NO_EPOCH for part in parts]

    # -- properties and housekeeping -------------------------------------------------------

    @property
    def namespace(self) -> str:
        return self._parts[0].namespace

    @property
    def retention(self) -> float:
        return self._parts[0].retention

    def now(self) -> datetime:
        return self._parts[0].now()

    def ping(self) -> bool:
        return all(part.ping() for part in self._parts)

    def setup(self) -> None:
        first = self._parts[0]
        with first._wrap("setup"):
            pinned = as_text(first._run("pin_shards", [self._marker], [self._n]))
        if pinned != str(self._n):
            raise pinned_elsewhere(self._n, pinned, self.namespace)
        for part in self._parts:
            part.setup()

    def schema_version(self) -> int | None:
        versions = [part.schema_version() for part in self._parts]
        known = [v for v in versions if v is not None]
        return max(known) if known else None

    def check_config(self, *, replicas: bool = True) -> None:
        self._parts[0].check_config(replicas=False)  # the policy: reads every master
        if replicas:
            self.check_replicas()  # the master of every shard, not only the first's

    def replica_counts(self) -> dict[str, int]:
        """The replicas connected to each master holding a shard, by master (``host:port``)."""
        counts: dict[str, int] = {}
        for part in self._parts:
            counts.update(part.replica_counts())
        return counts

    def check_replicas(self) -> dict[str, int]:
        """:meth:`replica_counts`, refused if a master has fewer than ``exactonce_min_replicas``."""
        first = self._parts[0]
        return first._enough_replicas(self.replica_counts()) if first._min_replicas else {}

    def drop_namespace(self) -> None:
        for part in self._parts:
            part.drop_namespace()
        first = self._parts[0]
        with first._wrap("drop_namespace"):
            first._client.delete(self._marker)

    def close(self) -> None:
        for part in self._parts:
            part.close()

    def shares_server(self, connection_kwargs: Any) -> int | None:
        """Never: a script on a cluster touches one slot, and the broker is elsewhere."""
        return None

    # -- epoch and create ------------------------------------------------------------------

    def epoch(self, *, replace: str | None = None) -> str:
        """Every shard's epoch, joined by ``,`` in shard order (each created if absent).

        With ``replace`` (such a list), each shard whose epoch is still its part
        of it starts a new one, by compare-and-set, as one slot's
        :meth:`~celery_exactonce.stores.base.StateStore.epoch` does; a part that
        is no epoch (:data:`~celery_exactonce.core.refs.NO_EPOCH`) leaves that shard's
        as it is. So a node replaces the epochs of the shards it found lost, and
        only those. A list of another length matches no shard: nothing is replaced.
        """
        olds = self._split_epoch(replace)
        return EPOCHS_SEPARATOR.join(
            part.epoch(replace=old) for part, old in zip(self._parts, olds, strict=True)
        )

    def create(self, new: NewJob, *, epoch: str | None = None) -> CreateResult:
        return self.create_many([new], epoch=epoch)[0]

    def create_many(
        self, news: Sequence[NewJob], *, epoch: str | None = None, brief: bool = False
    ) -> list[CreateResult]:
        epochs = self._split_epoch(epoch)
        out: list[CreateResult | None] = [None] * len(news)
        current: dict[int, str | None] = {}
        refused = False
        for shard, indexes in self._grouped(news, self._home).items():
            batch = [news[i] for i in indexes]
            answers = self._parts[shard].create_many(batch, epoch=epochs[shard], brief=brief)
            for i, answer in zip(indexes, answers, strict=True):
                self._remember(news[i].ref, shard)
                out[i] = answer
                current[shard] = answer.epoch
                refused = refused or answer.status is CreateStatus.EPOCH_MISMATCH
        results = [answer for answer in out if answer is not None]
        if epoch is None:
            return results  # each answer names its own shard's epoch: no extra read
        # The answers name the namespace's epoch: the shards answered theirs; the others
        # are the ones held, or (after a refusal, which is rare) read.
        for shard, part in enumerate(self._parts):
            if shard not in current:
                current[shard] = self._read_epoch(part) if refused else epochs[shard]
        whole = EPOCHS_SEPARATOR.join(current[s] or "" for s in range(self._n))
        return [dataclasses.replace(answer, epoch=whole) for answer in results]

    def _read_epoch(self, part: RedisStore) -> str | None:
        with part._wrap("epoch"):
            value = part._client.get(part._key("epoch"))
        return None if value is None else as_text(value)

    # -- reads and transitions ---------------------------------------------------------------

    def get(self, ref: JobRef) -> Job | None:
        shard, job = self._locate(ref)
        return job if job is not None else self._parts[shard].get(ref)

    def transition(self, ref: JobRef, request: Transition) -> TransitionResult:
        return self._routed(
            [ref], lambda shard, _: [self._parts[shard].transition(ref, request)], found
        )[0]

    def transition_many(
        self, requests: Sequence[tuple[JobRef, Transition]], *, brief: bool = False
    ) -> list[TransitionResult]:
        def run(shard: int, indexes: list[int]) -> list[TransitionResult]:
            batch = [requests[i] for i in indexes]
            return self._parts[shard].transition_many(batch, brief=brief)

        return self._routed([ref for ref, _ in requests], run, found)

    def heartbeat(self, ref: JobRef, run_id: str) -> bool:
        # False is also a run that lost the job: then the search finds nothing elsewhere.
        return self._routed(
            [ref], lambda shard, _: [self._parts[shard].heartbeat(ref, run_id)], bool
        )[0]

    def annotate(self, ref: JobRef, *, node: str, reason: str, op_id: str) -> bool:
        def run(shard: int, _: list[int]) -> list[bool]:
            return [self._parts[shard].annotate(ref, node=node, reason=reason, op_id=op_id)]

        return self._routed([ref], run, bool)[0]

    def watermark(self, entry: str) -> datetime | None:
        return self.watermarks([entry]).get(entry)

    def watermarks(self, entries: Sequence[str]) -> dict[str, datetime]:
        marks: dict[str, datetime] = {}
        for shard, indexes in self._grouped(entries, lambda e: shard_of(e, self._n)).items():
            marks.update(self._parts[shard].watermarks([entries[i] for i in indexes]))
        return marks

    def note_skipped(self, skipped: Sequence[SkippedSlots]) -> None:
        for shard, indexes in self._grouped(skipped, lambda s: shard_of(s.entry, self._n)).items():
            self._parts[shard].note_skipped([skipped[i] for i in indexes])
