"""RedisStore: the job store in Redis, one Lua script per operation.

Every operation of the :class:`~celery_exactonce.stores.base.StateStore`
contract is defined here, on :class:`RedisStore` itself, and is one round
trip: one Lua script (``stores/redis/lua/*.lua``, atomic on the server), a plain
command (``TIME``, ``PING``, ``HGETALL``, ``HMGET``), or, for
``create_many``/``transition_many``, a pipeline of script calls, each job
applied atomically. All times are integer microseconds since the UNIX epoch,
read from Redis ``TIME`` inside the scripts (store time). Redis must run with
``maxmemory-policy noeviction`` (:meth:`RedisStore.check_config`).

What the operations stand on lives in the classes and functions
:class:`RedisStore` is made of, one module each:

* :mod:`~celery_exactonce.stores.redis.keys`: the key layout (every key of a
  namespace under ``{prefix}:{<namespace>}:``, one Redis Cluster slot) and the
  methods that name the keys;
* :mod:`~celery_exactonce.stores.redis.base`: the store's state (and
  ``from_url``, the store on a new client), running a script (``EVALSHA``,
  reloaded on a server that lacks it; batches pipelined), driver errors turned
  into store errors;
* :mod:`~celery_exactonce.stores.redis.client`: the client built from a URL,
  the server named in messages, whether a broker shares it, its
  ``maxmemory-policy``;
* :mod:`~celery_exactonce.stores.redis.codec`: the scripts' arguments (a
  record's fields, history entries) and replies (records, results);
* :mod:`~celery_exactonce.stores.redis.batches`: the keys and arguments of
  the batch scripts, ``create`` and ``transition``, shared and per job;
* :mod:`~celery_exactonce.stores.redis.enqueue`: the enqueue's :class:`Push`,
  :class:`PushRefused`, the script's arguments, call (overlapped) and reply;
* :mod:`~celery_exactonce.stores.redis.reads`: the reads for people behind
  ``list_jobs`` and ``lease`` (a filtered listing, a lease's holder).

Here: the operations, each with the keys it passes (the batch scripts', from
:class:`~celery_exactonce.stores.redis.batches.RedisBatches`) and the script it runs.
They stay here, not in those classes, so that whatever wraps a store class's
operations (the acceptance tests' fault injection) finds each one in
``RedisStore.__dict__``. :class:`Push`, :class:`PushRefused` and
:data:`SCRIPT_BATCH` are importable from here as well. Not here: what the
operations stand on (the modules above).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

import redis.exceptions as rexc

from celery_exactonce.core import exceptions, jobs, refs, times
from celery_exactonce.core.jobs import CreateResult, Job, TransitionResult
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.skipped_slots import SkippedSlots
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import Lease, NewJob, Transition
from celery_exactonce.observe import metrics
from celery_exactonce.stores import shards
from celery_exactonce.stores.base import FORMAT_VERSION, SKIPPED_KEPT, DueBacklog, Run
from celery_exactonce.stores.redis.base import SCRIPT_BATCH
from celery_exactonce.stores.redis.batches import RedisUnique
from celery_exactonce.stores.redis.client import masters, maxmemory_policy, same_server
from celery_exactonce.stores.redis.cluster import ClusterClient
from celery_exactonce.stores.redis.codec import (
    as_text,
    create_result,
    decode_hash,
    decode_job,
    due_backlog_result,
    lease_ms,
    opt,
    transition_result,
)
from celery_exactonce.stores.redis.enqueue import Push, PushRefused, RedisEnqueue
from celery_exactonce.stores.redis.reads import RedisReads, filtered

__all__ = ["SCRIPT_BATCH", "Push", "PushRefused", "RedisStore"]


class RedisStore(RedisReads, RedisEnqueue, RedisUnique):
    """A :class:`~celery_exactonce.stores.base.StateStore` in Redis.

    Parameters
    ----------
    client
        A ``redis.Redis`` client (``decode_responses`` either way). The store
        does not close a client it was given.
    namespace
        The namespace every key lives under (validated).
    retention
        Seconds a terminal record is kept, from ``max(fire_time, terminal_at)``.
    prefix
        The first part of every key (``exactonce_key_prefix``): 1-64 letters,
        digits, ``_``, ``.`` or ``-``.
    """

    def __repr__(self) -> str:
        return f"RedisStore({self._where}, namespace={self._namespace!r})"

    # -- properties and housekeeping ---------------------------------------------------

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def retention(self) -> float:
        return self._retention

    def now(self) -> datetime:
        with self._wrap("TIME"):
            seconds, micros = self._node(self._key("meta")).time()
        return times.from_micros(int(seconds) * 1_000_000 + int(micros))

    def ping(self) -> bool:
        """Whether Redis answers (raises :class:`StoreUnavailable` when it does not)."""
        with self._wrap("PING"):
            return bool(self._node(self._key("meta")).ping())

    def setup(self) -> None:
        args = [FORMAT_VERSION, self._namespace, self._shards]
        with self._wrap("setup"):
            stored = self._run("setup", [self._key("meta")], args)
        if as_text(stored).startswith("shards="):
            raise shards.pinned_elsewhere(self._shards, as_text(stored)[7:], self._namespace)
        if self._version(as_text(stored)) > FORMAT_VERSION:
            raise self._newer(as_text(stored))

    def _version(self, version: str) -> int:
        if not version.isdigit():
            raise self._newer(version)
        return int(version)

    def _newer(self, version: str) -> exceptions.SchemaMismatch:
        return exceptions.SchemaMismatch(
            f"Redis store {self._where}, namespace {self._namespace!r}: key format "
            f"{version!r} is not one this version reads (it writes {FORMAT_VERSION}); "
            "upgrade celery-exactonce"
        )

    def schema_version(self) -> int | None:
        with self._wrap("schema_version"):
            stored = self._client.hget(self._key("meta"), "format_version")
        return None if stored is None else self._version(as_text(stored))

    def check_config(self, *, replicas: bool = True) -> None:
        """Refuse a Redis that may evict keys, or (``replicas``) lacks ``min_replicas`` replicas.

        Reads ``CONFIG GET``, or ``INFO memory`` when ``CONFIG`` is disabled or
        renamed (on a cluster, on every master); when neither is readable, logs
        a warning and passes. The
        replicas: :meth:`check_replicas`.
        """
        with self._wrap("check_config"):
            policies = [maxmemory_policy(server) for server in masters(self._client)]
        evicting = [policy for policy in policies if policy not in (None, "noeviction")]
        if evicting:
            raise exceptions.ConfigurationError(
                f"exactonce_store_url={self._where!r}: Redis maxmemory-policy is "
                f"{evicting[0]!r}; it must be 'noeviction' (an evicted record could let a "
                "job run twice)",
                setting="exactonce_store_url",
            )
        if None in policies:
            metrics.event(
                "store_config_unknown",
                f"cannot read maxmemory-policy of Redis store {self._where}; it must be noeviction",
                level=logging.WARNING,
            )
        if replicas:
            self.check_replicas()

    def drop_namespace(self) -> None:
        """Delete every key of this namespace (records, indexes, epoch, leases, meta)."""
        pattern = f"{self._base}:*"
        with self._wrap("drop_namespace"):
            server = self._node(self._key("meta"))  # every key of the namespace is there
            batch: list[Any] = []
            for key in server.scan_iter(match=pattern, count=500):
                batch.append(key)
                if len(batch) >= 500:
                    server.delete(*batch)
                    batch = []
            if batch:
                server.delete(*batch)

    def close(self) -> None:
        if not self._closed and self._owns_client:
            with contextlib.suppress(rexc.RedisError, OSError):
                self._client.close()
                if not isinstance(self._client, ClusterClient):
                    self._client.connection_pool.disconnect()
        self._closed = True

    # -- epoch and create ----------------------------------------------------------------

    def epoch(self, *, replace: str | None = None) -> str:
        args = [refs.new_token(), opt(replace)]
        with self._wrap("epoch"):
            return as_text(self._run("epoch", [self._key("epoch")], args))

    def create(self, new: NewJob, *, epoch: str | None = None) -> CreateResult:
        with self._wrap("create"):
            return create_result(self._run_batched("create", *self._create_batch([new], epoch))[0])

    def create_many(
        self, news: Sequence[NewJob], *, epoch: str | None = None, brief: bool = False
    ) -> list[CreateResult]:
        """One pipelined round trip of ``create`` calls, each job created atomically."""
        batch = self._create_batch(news, epoch, brief)
        with self._wrap("create_many"):
            return [create_result(reply) for reply in self._run_batched("create", *batch)]

    # -- create and enqueue (a broker on this server) ------------------------------------

    def shares_server(self, connection_kwargs: Mapping[str, Any]) -> int | None:
        """This store's database if ``connection_kwargs`` (redis-py's) reach its server; else None.

        The same host and port (or unix socket) as this store's client, which
        must be a plain client (a cluster has no databases, and a script there
        may only touch its own slot), not behind Sentinel, and no
        ``min_replicas`` (the script would push before ``WAIT`` confirms the
        record): then :meth:`enqueue` can push to that server's broker database.
        """
        if self._min_replicas or not same_server(self._client, connection_kwargs):
            return None
        return self._db

    def enqueue(
        self, new: NewJob, dispatch: Transition, push: Push | None = None, *, meanwhile: Run = None
    ) -> CreateResult:
        """Create ``new`` straight into ``DISPATCHED`` (and run ``push``), atomically.

        ``new`` (``SCHEDULED``) is written with ``dispatch`` (``SCHEDULED →
        DISPATCHED``) applied, both in its history, by the script that runs the
        broker commands: the record and the message exist together or not at
        all. Without ``push`` (a broker elsewhere) the record alone, the one write
        before the caller's publish, whose message ``meanwhile`` may build while
        the answer is on the way (:meth:`_run_meanwhile`). ``CREATED`` (``job``
        unset), or ``EXISTS`` with the record, nothing pushed. :class:`PushRefused`:
        Redis refused a broker command (nothing written). Any other error: read back.
        """
        keys, args = self._enqueue_call(new, dispatch, push)
        with self._wrap("enqueue"):
            try:
                reply = self._run_meanwhile(keys, args, meanwhile)
            except rexc.NoPermissionError as exc:  # an ACL refused the call: it did not run
                if push is None:
                    raise
                raise self._push_refused(f"enqueue refused: {exc}") from exc
        return self._enqueued(reply)

    def get(self, ref: JobRef) -> Job | None:
        with self._wrap("get"):
            record = self._confirmed_read("HGETALL", self._job_key(ref))
        return decode_hash(record, ref)

    def watermark(self, entry: str) -> datetime | None:
        return self.watermarks([entry]).get(entry)

    def watermarks(self, entries: Sequence[str]) -> dict[str, datetime]:
        if not entries:
            self._check_open()
            return {}
        with self._wrap("watermarks"):
            marks = self._client.hmget(self._key("wm"), list(entries))
        return {
            entry: times.from_micros(int(as_text(mark)))
            for entry, mark in zip(entries, marks, strict=True)
            if mark is not None
        }

    # -- skipped slots ------------------------------------------------------------------

    def note_skipped(self, skipped: Sequence[SkippedSlots]) -> None:
        if not skipped:
            self._check_open()
            return
        at = self.now()
        records = [
            json.dumps(dataclasses.replace(r, at=at).to_json(), separators=(",", ":"))
            for r in skipped
        ]
        key = self._key("skipped")
        with self._wrap("note_skipped"):
            pipe = self._node(key).pipeline(transaction=True)
            pipe.lpush(key, *records)
            pipe.ltrim(key, 0, SKIPPED_KEPT - 1)
            pipe.execute()

    def skipped(self, limit: int = 100) -> list[SkippedSlots]:
        if limit <= 0:
            self._check_open()
            return []
        cutoff = self.now() - timedelta(seconds=self._retention)
        with self._wrap("skipped"):
            raw = self._client.lrange(self._key("skipped"), 0, limit - 1)
        records = [SkippedSlots.from_json(json.loads(as_text(item))) for item in raw]
        return [r for r in records if r.at is not None and r.at >= cutoff]

    # -- transitions ---------------------------------------------------------------------

    def transition(self, ref: JobRef, request: Transition) -> TransitionResult:
        with self._wrap("transition"):
            reply = self._run_batched("transition", *self._transition_batch([(ref, request)]))
        return transition_result(reply[0])

    def transition_many(
        self, requests: Sequence[tuple[JobRef, Transition]], *, brief: bool = False
    ) -> list[TransitionResult]:
        """One pipelined round trip of ``transition`` calls, each job's CAS atomic."""
        batch = self._transition_batch(requests, brief)
        with self._wrap("transition_many"):
            return [transition_result(reply) for reply in self._run_batched("transition", *batch)]

    def heartbeat(self, ref: JobRef, run_id: str) -> bool:
        keys = [self._job_key(ref), self._state_key(State.RUNNING)]
        with self._wrap("heartbeat"):
            return bool(self._run("heartbeat", keys, [run_id, str(ref)]))

    def annotate(self, ref: JobRef, *, node: str, reason: str, op_id: str) -> bool:
        reason = jobs.check_note(node, reason, op_id)
        with self._wrap("annotate"):
            return bool(self._run("annotate", [self._job_key(ref)], [node, reason, op_id]))

    # -- queries and sweeps --------------------------------------------------------------

    def count_by_state(self) -> dict[State, int]:
        with self._wrap("count_by_state"):
            counts = self._run("count_states", self._state_keys(), [])
        return {state: int(n) for state, n in zip(State, counts, strict=True)}

    def due_backlog(self) -> DueBacklog:
        with self._wrap("due_backlog"):
            return due_backlog_result(self._run("due_backlog", [self._due_key], []))

    def list_stale(
        self,
        state: State,
        older_than: float,
        limit: int,
        *,
        after: tuple[datetime, JobRef] | None = None,
    ) -> list[Job]:
        if limit <= 0:
            self._check_open()
            return []
        age = timedelta(seconds=older_than) // timedelta(microseconds=1)  # as the memory store
        keys = [self._state_key(State(state)), self._key("job", "")]
        # The cursor is the index's own (score, member) of the previous page's last job.
        at, member = (None, None) if after is None else (times.to_micros(after[0]), after[1])
        args = [age, limit, opt(at), opt(member)]
        with self._wrap("list_stale"):
            records = self._run("list_stale", keys, args)
        return [decode_job(flat) for flat in records]

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
        """:meth:`list_stale`'s pages, the task and the entry matched on the records read."""
        if task is None and entry is None:
            return self.list_stale(state, older_than, limit, after=after)
        return filtered(self.list_stale, State(state), limit, after, older_than, task, entry)

    def claim_due(self, limit: int, *, node: str, reason: str = "claimed") -> list[Job]:
        refs.validate_identifier(node, "node id", refs.MAX_NAME_LENGTH)
        refs.validate_reason(reason)
        if limit <= 0:
            self._check_open()
            return []
        keys = [
            self._key("due"),
            self._state_key(State.PENDING),
            self._state_key(State.SCHEDULED),
            self._key("job", ""),
        ]
        with self._wrap("claim_due"):
            records = self._run("claim_due", keys, [limit, refs.new_token(), node, reason])
        return [decode_job(flat) for flat in records]

    def purge_expired(self, limit: int) -> int:
        if limit <= 0:
            self._check_open()
            return 0
        keys = [self._key("expire"), self._key("due"), self._key("job", ""), *self._state_keys()]
        with self._wrap("purge_expired"):
            return int(self._run("purge_expired", keys, [limit, self._retention_us]))

    # -- leases --------------------------------------------------------------------------

    def acquire_lease(self, name: str, token: str, ttl: float) -> bool:
        Lease(name, token)  # validates
        with self._wrap("acquire_lease"):
            return bool(
                self._run("lease_acquire", [self._key("lease", name)], [token, lease_ms(ttl)])
            )

    def renew_lease(self, name: str, token: str, ttl: float) -> bool:
        with self._wrap("renew_lease"):
            return bool(
                self._run("lease_renew", [self._key("lease", name)], [token, lease_ms(ttl)])
            )

    def lease(self, name: str) -> tuple[str, datetime] | None:
        return self._lease(name)

    def release_lease(self, name: str, token: str) -> bool:
        with self._wrap("release_lease"):
            return bool(self._run("lease_release", [self._key("lease", name)], [token]))
