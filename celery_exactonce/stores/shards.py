"""``exactonce_shards``: the shard of a job or a beat entry, and each shard's key base.

A namespace of ``N`` shards (``exactonce_shards``, pinned: every node must
agree, and changing it needs a migration) keeps each shard's keys under its
own Redis Cluster hash tag, so that each shard is one slot and the shards
spread over the cluster's masters. Redis hashes only the *first* ``{...}`` of
a key, so the shard sits inside it:

* ``N = 1``: ``{prefix}:{<namespace>}``, the one-slot layout, unchanged;
* ``N > 1``: shard ``s`` is ``{prefix}:{<namespace>:<s>}`` or, when that tag's
  slot is not where shard ``s`` belongs, ``{prefix}:{<namespace>:<s>.<k>}``
  with the least ``k`` whose slot is (a namespace is ``[A-Za-z0-9_.-]``, so
  ``:`` cannot be part of one). Where shard ``s`` belongs: the middle half of
  the ``s``-th of ``N`` equal parts of the 16,384 slots
  (:func:`slot_range`). A cluster created by ``redis-cli --cluster create``
  gives each of its ``M`` masters an equal run of slots, so with ``N`` a
  multiple of ``M`` every master holds ``N / M`` shards; left to CRC16 alone,
  three shards share a master two times in three.

:func:`shard_of` is pinned (golden vectors in tests/unit/stores/test_shards.py, as
for idempotency keys): the first four bytes of the SHA-1 of the text, big
endian, modulo ``N``.

:func:`check_setting` refuses ``N > 1`` off a Redis Cluster. The store that
routes over the shards: :mod:`~celery_exactonce.stores.redis.sharded`.
"""

from __future__ import annotations

import hashlib

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from celery_exactonce.core import exceptions

#: Tags tried per shard before giving up: a try lands with odds ``1 / (2 N)``, so
#: ``N`` up to the cluster's 16,384 slots finds one long before.
_MAX_TRIES = 1_000_000

#: The URL schemes of a Redis Cluster store, the only store where shards mean anything.
_CLUSTER_SUFFIX = "+cluster"


def shard_of(text: str, shards: int) -> int:
    """The shard, in ``range(shards)``, of a job id or a beat entry's key (pinned)."""
    if shards == 1:
        return 0
    digest = hashlib.sha1(text.encode("utf-8"), usedforsecurity=False).digest()
    return int.from_bytes(digest[:4], "big") % shards


def slot_range(shard: int, shards: int) -> range:
    """The cluster slots shard ``shard`` of ``shards`` may take: the middle half of its part.

    The middle half, not the whole part, so that a cluster whose masters split
    the slots a little off the exact fractions (``redis-cli`` rounds) still
    puts the shard on the master that holds its part.
    """
    low = shard * REDIS_CLUSTER_HASH_SLOTS // shards
    high = (shard + 1) * REDIS_CLUSTER_HASH_SLOTS // shards
    quarter = (high - low) // 4
    return range(low + quarter, high - quarter)


def shard_base(base: str, shard: int, shards: int) -> str:
    """The base of shard ``shard`` of ``shards``, from the one-slot base ``{prefix}:{<ns>}``.

    With one shard, ``base`` itself: the layout (and every key) of today.
    Otherwise the first tag, ``<ns>:<shard>`` then ``<ns>:<shard>.1``,
    ``<ns>:<shard>.2``..., whose slot is in :func:`slot_range` (pinned: the
    keys of a namespace's shards are found by it).
    """
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} not in range({shards})")
    if shards == 1:
        return base
    if not base.endswith("}"):
        raise ValueError(f"not a namespace base: {base!r}")
    wanted = slot_range(shard, shards)
    for k in range(_MAX_TRIES):
        tag = f"{base[:-1]}:{shard}" + (f".{k}" if k else "")
        if key_slot(f"{tag}}}".encode()) in wanted:
            return f"{tag}}}"
    raise ValueError(f"no tag of shard {shard} of {shards} hashes into {wanted}")


def shard_bases(base: str, shards: int) -> list[str]:
    """The base of every shard, shard 0 first."""
    return [shard_base(base, s, shards) for s in range(shards)]


def check_setting(shards: int, url: str, shown_url: str) -> None:
    """Refuse ``exactonce_shards`` above 1 off a Redis Cluster, where it means nothing.

    ``shown_url`` is ``url`` redacted, for the message.
    """
    if shards == 1 or url.split("://", 1)[0].lower().endswith(_CLUSTER_SUFFIX):
        return
    raise exceptions.ConfigurationError(
        f"exactonce_shards={shards}: only a Redis Cluster spreads a namespace over several "
        f"slots (store {shown_url}); one server or database holds every shard alike, so "
        "use exactonce_shards=1",
        setting="exactonce_shards",
    )


def pinned_elsewhere(shards: int, pinned: str, namespace: str) -> exceptions.ConfigurationError:
    """The refusal of a node whose ``exactonce_shards`` is not the one the namespace pins."""
    return exceptions.ConfigurationError(
        f"exactonce_shards={shards}: namespace {namespace!r} is laid out over {pinned} "
        "shard(s); every node must use the same value (changing it needs a migration: "
        "a record looked for on the wrong shard is invisible)",
        setting="exactonce_shards",
    )
