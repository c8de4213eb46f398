"""The Redis store's batch scripts: the keys and arguments of ``create`` and ``transition``.

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

Not here: the operations that run them
(:mod:`~celery_exactonce.stores.redis.store`, where every operation of the store is
defined), how a record's fields and a transition's arguments are encoded
(:mod:`~celery_exactonce.stores.redis.codec`), the key layout
(:mod:`~celery_exactonce.stores.redis.keys`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.stores.redis.base import RedisCore
from celery_exactonce.stores.redis.codec import create_args, opt, transition_args

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
