"""The Redis store's batch scripts' keys and arguments (``create``, ``transition``), and its
unique create.

``create``, ``create_many``, ``transition`` and ``transition_many`` run a
batch script (``stores/redis/lua/create.lua``, ``stores/redis/lua/transition.lua``), one
job or many. Such a script takes the keys and arguments every job of the call
shares, then each job's; :meth:`RedisCore._run_batched
<celery_exactonce.stores.redis.base.RedisCore._run_batched>` cuts the jobs into
calls and pipelines them. :class:`RedisBatches`, a base of
:class:`~celery_exactonce.stores.redis.store.RedisStore`, builds those two parts:

* ``create``: the epoch, the watermarks, the due index and every state index,
  with the epoch to check and whether the reply is brief; per job, its
  record's key and its fields;
* ``transition``: every state index, the due index and the expiry index, with
  the retention, whether the reply is brief and what a terminal record keeps
  (``exactonce_terminal_history``, ``exactonce_terminal_payload``); per job, its
  record's key, the key of the lease its transition checks (or a key no lease
  has) and the compare-and-swap's arguments.

:class:`RedisUnique` adds ``create_unique`` (:mod:`celery_exactonce.stores.unique`).
The namespace's index ``…:unique`` maps each unique key to the member of the
last job created with it. A unique create reads the key's holder, then runs
``stores/redis/lua/create_unique.lua`` with the holder's record among its
keys (a script reads only the keys it is given): if the index still names
that holder and it is live, nothing is written and the holder is the
answer; else the job is created as ``create`` creates it (``common.lua``'s
``create_job``), and becomes the holder, in the same script. If another
holder was set in between, the script writes nothing and says so, and the
create reads again (a holder changes only when the last one ended: a few
tries suffice). An index entry outlives its job (one field per key,
overwritten by the key's next job); a holder purged after its retention
holds nothing.

Not here: the operations that run them
(:mod:`~celery_exactonce.stores.redis.store`, where every operation of the store is
defined), how a record's fields and a transition's arguments are encoded
(:mod:`~celery_exactonce.stores.redis.codec`), the key layout
(:mod:`~celery_exactonce.stores.redis.keys`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery_exactonce.core import exceptions
from celery_exactonce.core.jobs import CreateResult
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.stores.redis.base import RedisCore
from celery_exactonce.stores.redis.codec import (
    as_text,
    create_args,
    create_result,
    opt,
    transition_args,
)

#: What a batch script is given: the keys and the arguments its jobs share, then each job's.
Batch = tuple[list[Any], list[Any], list[tuple[list[str], list[Any]]]]


class RedisBatches(RedisCore):
    """The calls of the batch scripts, ``create`` and ``transition``."""

    def _create_batch(
        self, news: Sequence[NewJob], epoch: str | None, brief: bool = False
    ) -> Batch:
        """The ``create`` script's shared keys and arguments, and each job's."""
        shared_keys = [self._key("epoch"), self._key("wm"), self._due_key, *self._index_keys]
        return (
            shared_keys,
            [opt(epoch), "1" if brief else "0"],
            [self._create_item(new) for new in news],
        )

    def _create_item(self, new: NewJob) -> tuple[list[str], list[Any]]:
        return [self._job_key(new.ref)], create_args(new)

    def _transition_batch(
        self, requests: Sequence[tuple[JobRef, Transition]], brief: bool = False
    ) -> Batch:
        """The ``transition`` script's shared keys and arguments, and each job's.

        A job's keys: its record, and the lease its transition checks (or a
        key no lease has).
        """
        shared_keys = [*self._index_keys, self._due_key, self._expire_key]
        shared_args = [self._retention_us, "1" if brief else "0", *self._compaction]
        return shared_keys, shared_args, [self._transition_item(*pair) for pair in requests]

    def _transition_item(self, ref: JobRef, request: Transition) -> tuple[list[str], list[Any]]:
        lease = request.lease
        keys = [
            self._job_key(ref),
            self._key("lease", lease.name) if lease else self._key("nolease"),
        ]
        return keys, transition_args(ref, request)


#: Reads of the key's holder a unique create makes before it gives up (each one after
#: another create won the key, and that job ended, in between).
READS = 5


class RedisUnique(RedisBatches):
    """``create_unique``, a base of :class:`~celery_exactonce.stores.redis.store.RedisStore`."""

    def create_unique(self, new: NewJob) -> CreateResult:
        key = new.unique
        if key is None:
            raise exceptions.InvalidRequest(f"job {new.ref}: a unique create needs a key")
        index = self._key("unique")
        shared_keys, shared_args, ((job_keys, job_args),) = self._create_batch([new], None)
        with self._wrap("create_unique"):
            seen = as_text(self._client.hget(index, key) or "")
            for _ in range(READS):
                holder = self._job_key(JobRef.parse(seen)) if seen else job_keys[0]
                keys = [*shared_keys, *job_keys, index, holder]
                reply = self._run("create_unique", keys, [*shared_args, *job_args, key, seen])
                if as_text(reply[0]) != "moved":
                    return create_result(reply)
                seen = as_text(reply[1])
        raise exceptions.StoreUnavailable(
            f"unique create of {new.ref}: the holder of its key changed {READS} times "
            "while it was read"
        )
