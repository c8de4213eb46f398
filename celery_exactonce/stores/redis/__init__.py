"""The Redis store: :class:`RedisStore`, split by concern.

``store`` keeps every operation of the contract, on ``base`` (its state, its
scripts, its errors); ``keys`` is the key layout; ``client``, ``sentinel``,
``cluster`` and ``hosts`` build clients from URLs; ``codec`` and ``batches``
shape the scripts' arguments and replies; ``enqueue`` is the one-step
enqueue's push; ``reads`` the CLI's listings; ``errors`` the driver errors
that may pass on a retry. ``sharded`` is the store over several shards of a
cluster, on ``sharded_routes`` and ``sharded_scans``. The Lua scripts are in
``lua/``.
"""

from __future__ import annotations

from celery_exactonce.stores.redis.store import RedisStore

__all__ = ["RedisStore"]
