"""The Redis store's unique creates (:mod:`celery_exactonce.stores.unique`).

The namespace's index ``…:unique`` maps each unique key to the member of the
last job created with it. A unique create reads the key's holder, then runs
``stores/redis/lua/create_unique.lua`` with the holder's record among its
keys (a script reads only the keys it is given): if the index still names
that holder and it is live, nothing is written and the holder is the answer;
else the job is created as ``create`` creates it, and becomes the holder, in
the same script. If another holder was set in between, the script writes
nothing and says so, and the create reads again (a holder changes only when
the last one ended: a few tries suffice).

An index entry outlives its job (it is one field per key, overwritten by the
key's next job); a holder purged after its retention holds nothing.

Not here: the create itself (``create.lua``, through ``common.lua``'s
``create_job``), the store's other operations
(:mod:`~celery_exactonce.stores.redis.store`).
"""

from __future__ import annotations

from celery_exactonce.core import exceptions
from celery_exactonce.core.jobs import CreateResult
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.writes import NewJob
from celery_exactonce.stores.redis.batches import RedisBatches
from celery_exactonce.stores.redis.codec import as_text, create_result

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
