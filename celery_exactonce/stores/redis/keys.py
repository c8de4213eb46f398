"""The Redis store's key layout: which keys a namespace has, and how the store names them.

Every key of a namespace lives under ``{prefix}:{<namespace>}:``, the namespace
in a Redis Cluster hash tag so all of them share one slot (scripts may touch
several). With ``base = "{prefix}:{<namespace>}"``:

====================================  ======  ==================================================
key                                   type    content
====================================  ======  ==================================================
``base:job:<space>:<id>``             HASH    one record; scalar fields, ``args``/``kwargs``/
                                              ``options`` as opaque JSON, ``history`` a JSON array
``base:state:<STATE>``                ZSET    ``str(JobRef)`` by ``touched_at`` (one per state)
``base:due``                          ZSET    ``PENDING`` jobs by ``run_at``
``base:expire``                       ZSET    terminal jobs by ``max(fire_time, terminal_at)
                                              + retention``
``base:wm``                           HASH    beat entry -> watermark (``fire_time``)
``base:epoch``                        STRING  the store epoch
``base:lease:<name>``                 STRING  the lease token, with a ``PX`` expiry
``base:meta``                         HASH    ``format_version``, ``namespace``
``base:entries``                      HASH    stored beat entry -> its definition (JSON);
                                              ``""`` -> their revision
====================================  ======  ==================================================

Index members are ``str(JobRef)`` (``t:<id>``), and a record's key is the job
key prefix followed by its member, so ids may hold any printable character.
The scripts (``stores/redis/lua/*.lua``) take every key as ``KEYS``; those that walk
an index get the job key prefix as a ``KEYS`` entry.

:func:`key_base` checks the prefix and gives ``base``; :class:`RedisKeys`, a
base of :class:`~celery_exactonce.stores.redis.store.RedisStore`, names the keys
from it.

With ``exactonce_shards`` above 1 each shard has all of these keys under its
own base (:mod:`~celery_exactonce.stores.shards`).

Not here: what a record's fields hold and how the scripts' arguments are
encoded (:mod:`~celery_exactonce.stores.redis.codec`), the scripts that read
and write these keys (``stores/redis/lua/``).
"""

from __future__ import annotations

import re

from celery_exactonce.core import exceptions
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State

_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def key_base(prefix: str, namespace: str) -> str:
    """``{prefix}:{<namespace>}``, the start of every key of a namespace; a bad prefix refused.

    The prefix (``exactonce_key_prefix``) is 1-64 letters, digits, ``_``,
    ``.`` or ``-``; the namespace is the caller's to validate.
    """
    if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix):
        raise exceptions.ConfigurationError(
            f"exactonce_key_prefix={prefix!r}: a key prefix is 1-64 letters, digits, "
            "'_', '.' or '-'",
            setting="exactonce_key_prefix",
        )
    return f"{prefix}:{{{namespace}}}"


class RedisKeys:
    """The keys of one namespace, named from ``_base`` (:func:`key_base`), which the store sets.

    The store also keeps the fixed keys every script call passes, built once:
    ``_index_keys`` (the state indexes, in :class:`State` order), ``_due_key``
    and ``_expire_key``.
    """

    _base: str
    _index_keys: list[str]
    _due_key: str
    _expire_key: str

    def _key(self, *parts: str) -> str:
        return ":".join((self._base, *parts))

    def _job_key(self, ref: JobRef) -> str:
        return self._key("job", str(ref))

    def _state_key(self, state: State) -> str:
        return self._key("state", state.value)

    def _state_keys(self) -> list[str]:
        """Every state index, in :class:`State` order (the scripts' ``STATES``)."""
        return list(self._index_keys)
