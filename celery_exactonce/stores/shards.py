"""``exactonce_shards``: the shard of a job or a beat entry, and each shard's key base.

A namespace of ``N`` shards (``exactonce_shards``, pinned: every node must
agree, and changing it needs a migration) keeps each shard's keys under its
own Redis Cluster hash tag, so that each shard is one slot and the shards
spread over the cluster's masters. Redis hashes only the *first* ``{...}`` of
a key, so the shard sits inside it:

* ``N = 1``: ``{prefix}:{<namespace>}``, the one-slot layout, unchanged;
* ``N > 1``: shard ``s`` is ``{prefix}:{<namespace>:<s>}`` (a namespace is
  ``[A-Za-z0-9_.-]``, so ``:`` cannot be part of one).

:func:`shard_of` is pinned (golden vectors in tests/unit/test_shards.py, as
for idempotency keys): the first four bytes of the SHA-1 of the text, big
endian, modulo ``N``.

:func:`check_setting` refuses ``N > 1`` off a Redis Cluster. The store that
routes over the shards: :mod:`~celery_exactonce.stores.redis_sharded`.
"""

from __future__ import annotations

import hashlib

from celery_exactonce import exceptions

#: The URL schemes of a Redis Cluster store, the only store where shards mean anything.
_CLUSTER_SUFFIX = "+cluster"


def shard_of(text: str, shards: int) -> int:
    """The shard, in ``range(shards)``, of a job id or a beat entry's key (pinned)."""
    if shards == 1:
        return 0
    digest = hashlib.sha1(text.encode("utf-8"), usedforsecurity=False).digest()
    return int.from_bytes(digest[:4], "big") % shards


def shard_base(base: str, shard: int, shards: int) -> str:
    """The base of shard ``shard`` of ``shards``, from the one-slot base ``{prefix}:{<ns>}``.

    With one shard, ``base`` itself: the layout (and every key) of today.
    """
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} not in range({shards})")
    if shards == 1:
        return base
    if not base.endswith("}"):
        raise ValueError(f"not a namespace base: {base!r}")
    return f"{base[:-1]}:{shard}}}"


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
