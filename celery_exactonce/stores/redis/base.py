"""What every operation of the Redis store stands on: its state, its scripts, its errors.

:class:`RedisCore` is the base of :class:`~celery_exactonce.stores.redis.store.RedisStore`
(through :class:`~celery_exactonce.stores.redis.enqueue.RedisEnqueue` and
the other bases). It holds what the constructor checks and builds (the
namespace, the retention, the key base and the fixed keys, the place named in
errors, the scripts), :meth:`RedisCore.from_url` (the store on a new client
for a URL, which it owns and closes), and:

* **scripts**: one Lua script per operation (``stores/redis/lua/<name>.lua``), each
  after ``common.lua`` and a header of the Python constants the scripts share
  (the states, the terminal ones, the history limit), registered on the
  client. :meth:`RedisCore._run` runs one with ``EVALSHA``; on a server that
  lacks it (restarted or flushed: the call did not run) it loads it and runs
  it again. :meth:`RedisCore._run_batched` runs a batch script (``create``,
  ``transition``) :data:`SCRIPT_BATCH` jobs to a call, the calls pipelined in
  one round trip (:meth:`RedisCore._run_many`);
* **replicas** (``exactonce_min_replicas`` ≥ 1): a counted write (the
  ``create``, ``transition`` and ``enqueue`` scripts: a claim, a gate write, a
  ``DISPATCHED`` write) is followed, in the same pipeline and on the same
  connection, by ``WAIT N timeout``; fewer than ``N`` replicas confirming it in
  time raises :class:`NotReplicated` (a ``StoreUnavailable``: the write's
  outcome is unknown, and its writer settles it by reading back). A
  confirmed read (:meth:`RedisCore._confirmed_read`, what ``get`` and so every
  read-back is) bumps a counter after reading and waits the same way, so that
  a record read back is one a promoted replica has too. On a cluster both go
  to the master of the namespace's slot (of the shard's, when sharded), so
  ``WAIT`` counts that master's replicas; start-up checks each such master
  (:meth:`RedisCore.check_replicas`). With ``N = 0`` none of this runs;
* **errors**: :meth:`RedisCore._wrap`, the one boundary of the store, turns
  driver errors into ``StoreUnavailable`` (retrying may help: the server is
  unreachable, slow, loading, failing over or read-only) or ``StoreError``
  (:mod:`~celery_exactonce.stores.redis.errors`, which also defines
  :class:`NotReplicated`, importable from here too), secrets blanked, and an
  identifier redis-py cannot encode into ``InvalidPayload``; on a cluster, the
  slot table read again after a redirection or no answer; an operation on a
  closed store is refused (``StoreError``).

All times are integer microseconds since the UNIX epoch, read from Redis
``TIME`` inside the scripts.

Not here: the operations themselves (:mod:`~celery_exactonce.stores.redis.store`),
the key layout (:mod:`~celery_exactonce.stores.redis.keys`), building the
client and reading the server's config
(:mod:`~celery_exactonce.stores.redis.client`), the scripts' arguments and
replies (:mod:`~celery_exactonce.stores.redis.codec`), the batch scripts'
keys and arguments (:mod:`~celery_exactonce.stores.redis.batches`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from importlib import resources
from typing import Any, TypeVar

import redis
import redis.exceptions as rexc

from celery_exactonce.core import exceptions, jobs
from celery_exactonce.core.states import TERMINAL, State
from celery_exactonce.stores import redact_secrets, redact_url, url_secrets, validate_namespace
from celery_exactonce.stores.redis.client import (
    Lane,
    address,
    client_from_url,
    describe,
    node,
    replicas,
)
from celery_exactonce.stores.redis.cluster import ClusterClient
from celery_exactonce.stores.redis.errors import REROUTE, NotReplicated, store_error
from celery_exactonce.stores.redis.keys import RedisKeys, key_base
from celery_exactonce.stores.shards import shard_base

__all__ = ["COUNTED", "SCRIPT_BATCH", "NotReplicated", "RedisCore"]

#: Jobs per call of a batch script (``create``, ``transition``): bounds how long one
#: call holds the server (a few milliseconds) while sparing most per-call costs.
SCRIPT_BATCH = 64

#: The scripts whose write counts only once ``min_replicas`` replicas confirm it.
COUNTED = frozenset({"create", "create_unique", "transition", "enqueue", "entry_write"})

#: The class :meth:`RedisCore.from_url` builds (the store).
_Store = TypeVar("_Store", bound="RedisCore")

_SCRIPTS = (
    "create",
    "create_unique",
    "transition",
    "heartbeat",
    "annotate",
    "list_stale",
    "claim_due",
    "purge_expired",
    "epoch",
    "pin_shards",
    "lease_acquire",
    "lease_renew",
    "lease_release",
    "setup",
    "enqueue",
    "count_states",
    "due_backlog",
    "entry_write",
)


def _lua_header() -> str:
    """The Python constants the scripts share, so Lua cannot drift from them."""
    states = ", ".join(f"'{s.value}'" for s in State)
    terminal = ", ".join(f"{s.value} = true" for s in State if s in TERMINAL)
    positions = ", ".join(f"{s.value} = {i}" for i, s in enumerate(State, 1))
    return (
        f"local STATES = {{{states}}}\n"
        f"local STATE_POS = {{{positions}}}\n"
        f"local TERMINAL = {{{terminal}}}\n"
        f"local HISTORY_LIMIT = {jobs.HISTORY_LIMIT}\n"
    )


def _lua(name: str) -> str:
    lua = resources.files("celery_exactonce.stores.redis").joinpath("lua")
    return lua.joinpath(f"{name}.lua").read_text(encoding="utf-8")


class RedisCore(RedisKeys):
    """The state of a Redis store, its scripts and its error boundary.

    The arguments are those of :class:`~celery_exactonce.stores.redis.store.RedisStore`.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        namespace: str,
        retention: float,
        prefix: str = "exactonce",
        min_replicas: int = 0,
        replica_timeout: float = 5.0,
        shard: int = 0,
        shards: int = 1,
        compaction: jobs.Compaction = jobs.KEEP,
    ) -> None:
        validate_namespace(namespace)
        base = shard_base(key_base(prefix, namespace), shard, shards)
        if retention <= 0:
            raise exceptions.ConfigurationError(
                "exactonce_retention must be > 0", setting="exactonce_retention"
            )
        self._client = client
        self._namespace = namespace
        self._retention = float(retention)
        self._retention_us = int(retention * 1_000_000)
        #: What a terminal record keeps: the transition script's arguments 3 to 5.
        kept = compaction.occurrence_retention
        self._compaction = [
            compaction.history,
            "1" if compaction.payload else "0",
            "" if kept is None or kept >= retention else f"={int(kept * 1_000_000)}",
        ]
        self._base = base
        self._shards = shards  # exactonce_shards, pinned in each shard's meta
        # The namespace's fixed keys, built once: every script call passes several.
        self._index_keys = [self._state_key(state) for state in State]
        self._due_key, self._expire_key = self._key("due"), self._key("expire")
        self._owns_client = False
        self._closed = False
        #: ``exactonce_min_replicas`` and the ``WAIT`` timeout (ms): see the module docs.
        self._min_replicas = int(min_replicas)
        self._wait_ms = max(1, int(replica_timeout * 1000))
        self._counted = COUNTED if self._min_replicas > 0 else frozenset()
        self._db, self._where, self._secrets = describe(client)
        header = _lua_header() + _lua("common")
        self._scripts = {name: client.register_script(header + _lua(name)) for name in _SCRIPTS}
        #: This thread's kept connection for single script calls, where the client suits.
        self._lane = Lane(client) if Lane.suits(client) else None

    @classmethod
    def from_url(
        cls: type[_Store],
        url: str,
        *,
        namespace: str,
        retention: float,
        prefix: str = "exactonce",
        socket_timeout: float = 5.0,
        min_replicas: int = 0,
        compaction: jobs.Compaction = jobs.KEEP,
        **kwargs: Any,
    ) -> _Store:
        """A store on a new client for ``url`` (``redis://``, ``rediss://``, ``unix://``, Sentinel,
        Cluster).

        The client does not retry commands by itself (``retry`` may be passed):
        a script resent after a timeout could apply twice and answer as if
        another writer had won, where the caller must instead settle the
        unknown outcome by reading the record back.

        With ``min_replicas`` ≥ 1 each counted write waits up to
        ``socket_timeout`` for its replicas, so the socket waits twice that.
        """
        client = client_from_url(url, socket_timeout, kwargs, min_replicas=min_replicas)
        store = cls(
            client,
            namespace=namespace,
            retention=retention,
            prefix=prefix,
            min_replicas=min_replicas,
            replica_timeout=socket_timeout,
            compaction=compaction,
        )
        store._owns_client = True
        store._where = redact_url(url)
        store._secrets += url_secrets(url)
        return store

    # -- scripts -------------------------------------------------------------------------

    def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """Run script ``name``: EVALSHA, and on a server that lacks it, load it and run it again.

        What redis-py's ``Script.__call__`` does, without the import and tuple
        copies it makes per call (a submit runs one script).
        """
        if name in self._counted:
            return self._run_many(name, [(keys, args)])[0]
        script = self._scripts[name]
        execute: Callable[..., Any] = (
            self._client.execute_command if self._lane is None else self._lane.call
        )
        try:
            return execute("EVALSHA", script.sha, len(keys), *keys, *args)
        except rexc.NoScriptError:  # a restarted or flushed server: the call did not run
            script.sha = self._client.script_load(script.script)
            return execute("EVALSHA", script.sha, len(keys), *keys, *args)

    def _run_batched(
        self,
        name: str,
        shared_keys: list[Any],
        shared_args: list[Any],
        items: Sequence[tuple[list[str], list[Any]]],
    ) -> list[Any]:
        """Run a batch script (``create``, ``transition``) over ``items``; a reply per item.

        The script takes its shared keys and arguments, then each item's; items
        go :data:`SCRIPT_BATCH` to a call, the calls in one pipelined round trip.
        Each item is applied atomically, not the batch: after an error, which
        items were applied is unknown (the caller reads them back).
        """
        calls: list[tuple[list[str], list[Any]]] = []
        for start in range(0, len(items), SCRIPT_BATCH):
            keys, args = list(shared_keys), list(shared_args)
            for item_keys, item_args in items[start : start + SCRIPT_BATCH]:
                keys += item_keys
                args += item_args
            calls.append((keys, args))
        if len(calls) == 1:
            return list(self._run(name, *calls[0]))
        return [reply for replies in self._run_many(name, calls) for reply in replies]

    def _run_many(self, name: str, calls: Sequence[tuple[list[str], list[Any]]]) -> list[Any]:
        """Run script ``name`` once per call in one pipelined round trip (not a transaction).

        Any error fails the whole batch (its outcomes unknown): the first error
        is raised once every reply is in.
        """
        if not calls:
            self._check_open()
            return []
        script = self._scripts[name]
        wait = name in self._counted
        replies = self._evalsha_many(script.sha, calls, wait)
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, rexc.NoScriptError)]
        if missing:  # a restarted or flushed server: those calls did not run; load, run them
            script.sha = self._client.script_load(script.script)
            retried = self._evalsha_many(script.sha, [calls[i] for i in missing], wait)
            for i, reply in zip(missing, retried, strict=True):
                replies[i] = reply
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    def _evalsha_many(
        self, sha: str, calls: Sequence[tuple[list[str], list[Any]]], wait: bool = False
    ) -> list[Any]:
        """EVALSHA per call in one pipeline; errors come back as values.

        Not ``Script.__call__`` on the pipeline: that costs a ``SCRIPT EXISTS``
        round trip per batch, where a missing script is rare and shows as
        ``NoScriptError`` replies (the call did not run) that :meth:`_run_many` handles.
        With ``wait``, ``WAIT`` ends the pipeline: :class:`NotReplicated` unless enough
        replicas confirm.
        """
        server = self._node(calls[0][0][0])
        with server.pipeline(transaction=False) as pipe:
            for keys, args in calls:
                pipe.evalsha(sha, len(keys), *keys, *args)
            if wait:
                pipe.wait(self._min_replicas, self._wait_ms)
            replies = list(pipe.execute(raise_on_error=False))
        if wait:
            self._check_replicas(replies.pop(), "write", server)
        return replies

    def _node(self, key: str) -> redis.Redis:
        """The plain client of the server serving ``key`` (on a cluster, its slot's master).

        A pipeline goes there, never through redis-py's cluster pipeline, which
        resends a command that timed out (a script could apply twice). A
        ``MOVED`` or ``ASK`` reply there (the slot moved: the command did not
        run), or no answer (the master died: a replica may be promoted), fails
        the operation as unavailable, and the slot table is read again.
        """
        return node(self._client, key)

    def _confirmed_read(self, command: str, *args: Any) -> Any:
        """Run read ``command``; with ``min_replicas``, confirm what it saw is on the replicas.

        ``WAIT`` waits for the writes of its own connection: a counter bumped
        after the read makes everything the read saw one of them. The three go
        on one connection to the master of the namespace's slot (where the
        counter is: the read's keys must be in that slot too), never through
        redis-py's cluster pipeline, which could send them to several.
        """
        if not self._min_replicas:
            return self._client.execute_command(command, *args)  # type: ignore[no-untyped-call]
        sync = self._key("sync")
        server = self._node(sync)
        with server.pipeline(transaction=False) as pipe:
            pipe.execute_command(command, *args)  # type: ignore[no-untyped-call]
            pipe.incr(sync)
            pipe.wait(self._min_replicas, self._wait_ms)
            reply, _, confirmed = pipe.execute()
        self._check_replicas(confirmed, "read", server)
        return reply

    def replica_counts(self) -> dict[str, int]:
        """The replicas connected to the master holding this namespace, by that master.

        On a cluster, the master of the namespace's slot, named ``host:port``;
        elsewhere the store's server, named as the store is (no credentials).
        """
        with self._wrap("check_replicas"):
            server = self._node(self._key("meta"))
            return {self._master_name(server): replicas(server)}

    def check_replicas(self) -> dict[str, int]:
        """:meth:`replica_counts`, refused if one is below ``exactonce_min_replicas`` (or none)."""
        if not self._min_replicas:
            return {}
        return self._enough_replicas(self.replica_counts())

    def _enough_replicas(self, counts: dict[str, int]) -> dict[str, int]:
        """``counts``, or the refusal naming the first master with too few replicas."""
        for master, connected in counts.items():
            if connected < self._min_replicas:
                which = "" if master == self._where else f": master {master}"
                raise exceptions.ConfigurationError(
                    f"exactonce_min_replicas={self._min_replicas}: Redis store {self._where}"
                    f"{which} has {connected} connected replica(s); no write could be "
                    f"confirmed on {self._min_replicas}",
                    setting="exactonce_min_replicas",
                )
        return counts

    def _master_name(self, server: redis.Redis) -> str:
        """How messages name ``server``: a cluster's node by address, else as the store."""
        return self._where if server is self._client else address(server)

    def _check_replicas(self, confirmed: Any, what: str, server: redis.Redis) -> None:
        if isinstance(confirmed, Exception):
            raise confirmed
        if int(confirmed) < self._min_replicas:
            master = self._master_name(server)
            at = "" if master == self._where else f" (master {master})"
            raise NotReplicated(
                redact_secrets(
                    f"Redis store {self._where}{at}: a {what} confirmed by {int(confirmed)} "
                    f"replica(s) of the {self._min_replicas} exactonce_min_replicas asks "
                    f"within {self._wait_ms} ms: its outcome is unknown",
                    self._secrets,
                )
            )

    # -- errors --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise exceptions.StoreError("the store is closed")

    @contextlib.contextmanager
    def _wrap(self, action: str) -> Iterator[None]:
        """Translate driver errors into the package's (the one boundary of this store)."""
        self._check_open()
        try:
            yield
        except rexc.RedisError as exc:
            if isinstance(exc, REROUTE) and isinstance(self._client, ClusterClient):
                with contextlib.suppress(rexc.RedisError, rexc.RedisClusterException):
                    self._client.refresh()
            message = redact_secrets(
                f"Redis store {self._where}: {action} failed: {type(exc).__name__}: {exc}",
                self._secrets,
            )
            raise store_error(exc, message) from exc
        except UnicodeError as exc:  # an identifier redis-py cannot encode (lone surrogate)
            raise exceptions.InvalidPayload(f"{action}: {exc}") from exc
