"""The Redis store's connection: the client it builds from a URL, the server it names, its config.

* :func:`client_from_url`: the client
  :meth:`RedisStore.from_url <celery_exactonce.stores.redis.store.RedisStore.from_url>`
  opens (``redis://``, ``rediss://``, ``unix://``, ``redis+sentinel://``
  through :mod:`~celery_exactonce.stores.redis.sentinel` and ``redis+cluster://``
  through :mod:`~celery_exactonce.stores.redis.cluster`), with redis-py's own
  command retry off, its commands packed by hiredis at once
  (:class:`HiredisPacker`), and a malformed URL refused as a
  ``ConfigurationError`` naming ``exactonce_store_url``, redacted;
* :func:`packed`: a command packed as a connection packs it, with hiredis at
  once where it packs with hiredis;
* :class:`Lane`: a connection each thread keeps for the store's own script
  calls (see its docs);
* :func:`describe`: what the store keeps of its client's connection: the
  database, the place its messages name (no password) and the password they
  must not show;
* :func:`same_server`: whether redis-py connection arguments reach the
  client's server (where the one-step enqueue can push to a broker database;
  never through Sentinel, whose master moves, nor on a cluster);
* :func:`masters` and :func:`node`: the plain clients of a cluster's masters,
  and of the master serving a key (a plain client's own server otherwise);
* :func:`replicas`: how many replicas the server has connected, from ``INFO replication``,
  and :func:`address`: a cluster node's ``host:port``, as messages name a master;
* :func:`maxmemory_policy`: the server's ``maxmemory-policy``, which must be
  ``noeviction``: from ``CONFIG GET``, else ``INFO memory``, else unknown.

Not here: the driver's errors turned into the package's and the scripts run
on the client (:mod:`~celery_exactonce.stores.redis.base`), what the store
does with a policy it reads
(:meth:`RedisStore.check_config <celery_exactonce.stores.redis.store.RedisStore.check_config>`).
"""

from __future__ import annotations

import _thread
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import redis
import redis.exceptions as rexc
from redis.backoff import NoBackoff
from redis.connection import HiredisRespSerializer
from redis.retry import Retry

from celery_exactonce.core import exceptions
from celery_exactonce.core.refs import process_id
from celery_exactonce.stores import redact_message, redact_url
from celery_exactonce.stores.redis.cluster import ClusterClient, cluster_client, is_cluster_url
from celery_exactonce.stores.redis.codec import as_text
from celery_exactonce.stores.redis.sentinel import (
    is_sentinel_client,
    is_sentinel_url,
    sentinel_client,
)

_hiredis: Any
try:
    import hiredis as _hiredis
except ImportError:  # pragma: no cover - redis[hiredis] is the dependency
    _hiredis = None


class HiredisPacker:
    """redis-py's hiredis packer, but a command of text, bytes and numbers goes to
    ``hiredis.pack_command`` at once: without redis-py's pass over every argument
    first (a gate's script call has ~30). Any other command is redis-py's to pack."""

    def __init__(self) -> None:
        self._redis_py = HiredisRespSerializer()

    def pack(self, *args: Any) -> list[bytes]:
        name = args[0]
        if type(name) is str and " " not in name:  # else redis-py splits it into words
            try:
                return [_hiredis.pack_command(args)]
            except TypeError:  # another type: redis-py converts it, or says why not
                pass
        return self._redis_py.pack(*args)  # type: ignore[no-any-return]


_PACKER = HiredisPacker()


def packed(conn: Any, command: tuple[Any, ...]) -> Any:
    """``command`` packed as ``conn`` packs it: where redis-py's hiredis packer would, as
    :class:`HiredisPacker` packs it (a client the store did not build, say)."""
    if (
        _hiredis is not None
        and type(getattr(conn, "_command_packer", None)) is HiredisRespSerializer
    ):
        return _PACKER.pack(*command)
    return conn.pack_command(*command)


def client_from_url(
    url: str, socket_timeout: float, kwargs: dict[str, Any], *, min_replicas: int = 0
) -> redis.Redis:
    """A new client for ``url``; ``kwargs`` go to ``redis.Redis.from_url``.

    The client does not retry commands by itself (unless ``kwargs`` pass a
    ``retry``): a script resent after a timeout could apply twice and answer
    as if another writer had won, where the caller must instead settle the
    unknown outcome by reading the record back. With ``min_replicas`` ≥ 1 a
    counted write waits up to ``socket_timeout`` for its replicas after it
    ran, so the socket waits twice that.
    """
    if min_replicas > 0:
        socket_timeout *= 2
    kwargs.setdefault("socket_connect_timeout", socket_timeout)
    kwargs.setdefault("retry", Retry(NoBackoff(), 0))
    if is_sentinel_url(url):
        return sentinel_client(url, socket_timeout, kwargs)
    if is_cluster_url(url):
        return cluster_client(url, socket_timeout, kwargs)
    if _hiredis is not None:
        kwargs.setdefault("command_packer", HiredisPacker())
    try:
        return redis.Redis.from_url(url, socket_timeout=socket_timeout, **kwargs)
    except (ValueError, TypeError) as exc:
        raise exceptions.ConfigurationError(
            f"exactonce_store_url={redact_url(url)!r}: {redact_message(str(exc), url)}",
            setting="exactonce_store_url",
        ) from None


def describe(client: redis.Redis) -> tuple[int, str, list[str]]:
    """The client's database, the place messages name (``redis://host:port/db``), its secrets.

    A cluster's: database 0 (it has no other), its URL redacted, its password.
    """
    if isinstance(client, ClusterClient):
        return 0, client.where, [client.password] if client.password else []
    kwargs = client.connection_pool.connection_kwargs
    db = int(kwargs.get("db") or 0)
    where = (
        f"unix://{kwargs['path']}"
        if kwargs.get("path")
        else f"redis://{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"
        f"/{kwargs.get('db', 0)}"
    )
    password = kwargs.get("password")
    return db, where, [str(password)] if password else []


def same_server(client: redis.Redis, connection_kwargs: Mapping[str, Any]) -> bool:
    """Whether ``connection_kwargs`` (redis-py's) reach the server of ``client``.

    The same host and port (or unix socket), and ``client`` a plain client (a
    cluster has no databases, and a script there may only touch its own slot).
    Never a client behind Sentinel: its master moves on a failover, and a
    broker's connection arguments cannot tell whether they name the same one.
    """
    if type(client) is not redis.Redis or is_sentinel_client(client):
        return False
    mine = client.connection_pool.connection_kwargs
    where = ("path", "host", "port")
    return not any(mine.get(name) != connection_kwargs.get(name) for name in where)


def masters(client: redis.Redis) -> list[redis.Redis]:
    """The plain clients of the servers that hold writes: a cluster's masters, else ``client``."""
    if isinstance(client, ClusterClient):
        return client.primaries()
    return [client]


def node(client: redis.Redis, key: str) -> redis.Redis:
    """The plain client of the server serving ``key``: on a cluster its slot's master."""
    if isinstance(client, ClusterClient):
        return client.node_client(key)
    return client


def maxmemory_policy(client: redis.Redis) -> str | None:
    """The server's ``maxmemory-policy``, or None when neither ``CONFIG`` nor ``INFO`` tells.

    Driver errors other than a refused command are the caller's to translate.
    """
    try:
        reply = client.config_get("maxmemory-policy")
        values = {as_text(k): as_text(v) for k, v in dict(reply).items()}
        if "maxmemory-policy" in values:
            return values["maxmemory-policy"]
    except rexc.ResponseError:
        pass  # CONFIG disabled or renamed: ask INFO
    try:
        info = client.info("memory")
        policy = dict(info).get("maxmemory_policy")
        return None if policy is None else as_text(policy)
    except rexc.ResponseError:
        return None


def address(server: redis.Redis) -> str:
    """``host:port`` of a plain client's server (a cluster's node), no credentials."""
    kwargs = server.connection_pool.connection_kwargs
    return f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"


def replicas(client: redis.Redis) -> int:
    """How many replicas the server has connected (``INFO replication``'s ``connected_slaves``)."""
    info = client.info("replication")
    return int(dict(info).get("connected_slaves", 0))


class _Kept:
    """The connection one thread keeps; given back to the pool when the thread ends."""

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self.conn: Any = pool.get_connection()
        self.pid = process_id()
        self._given_back = weakref.finalize(self, pool.release, self.conn)

    def drop(self) -> None:
        """Disconnect it (an answer may be left on it) and give it back to the pool now."""
        self.conn.disconnect()
        self._given_back()


def _fresh(conn: Any) -> None:
    """Make ``conn`` ready to send, as the pool makes a connection it hands out: one the
    server closed (it restarted, or dropped an idle client), or with an answer left on
    it, is connected again. One ``poll`` of the socket."""
    if conn._sock is None:
        return  # (connected as it sends)
    try:
        stale = conn.can_read()
    except (rexc.ConnectionError, rexc.TimeoutError, OSError):
        stale = True
    if stale:
        conn.disconnect()


class Lane:
    """Runs one command at a time on this thread's kept connection of ``client``'s pool.

    redis-py's ``execute_command`` takes a connection from the pool and gives it
    back for every command: a lock taken twice, the pool's metrics recorded four
    times, and a ``poll`` of the socket to make sure nothing is left unread on it.
    On a submit or a gate write, one script call each, that was a third of the
    client's cost of the round trip. :class:`Lane` takes a connection from the
    client's pool once per thread and keeps it: a call is the poll, the script
    sent and its answer read.

    A kept connection is given back to the pool when its thread ends (or dropped
    when the process forked: the pool then starts afresh by itself), and
    disconnected and given back after any error but an answer (a ``ResponseError``
    leaves the connection sound). Before each command its socket is polled, as
    the pool polls one it hands out: one the server closed (a restart) is
    connected again, so that the command is sent on a live connection.

    Only for a plain client on redis-py's own :class:`~redis.ConnectionPool`
    with real threads: not a cluster, not Sentinel (whose pool follows a
    failover per connection taken), not a client that retries by itself, not
    under an eventlet or gevent patch, where threads are green and a
    connection per green thread would stay out of the pool for as long as the
    thread lives; everything else takes redis-py's way.
    """

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._pool: redis.ConnectionPool = client.connection_pool
        self._local = threading.local()

    @staticmethod
    def suits(client: Any) -> bool:
        """Whether ``client`` can keep a connection per thread (see the class docs)."""
        if type(client) is not redis.Redis:  # (a cluster's client connects on first look)
            return False
        pool = client.connection_pool
        if type(pool) is not redis.ConnectionPool:
            return False
        if getattr(client, "connection", None) is not None:  # a single-connection client
            return False
        if threading.local is not _thread._local:  # green threads (eventlet, gevent)
            return False
        retry = pool.connection_kwargs.get("retry")
        return retry is None or not getattr(retry, "_retries", 0)

    def send(self, command: tuple[Any, ...]) -> Any:
        """Send ``command`` on this thread's connection; the connection, to :meth:`read` from."""
        kept: _Kept | None = getattr(self._local, "kept", None)
        if kept is None or kept.pid != process_id():  # none yet, or the parent's
            kept = self._local.kept = _Kept(self._pool)
        conn = kept.conn
        try:
            _fresh(conn)
            conn.send_packed_command(packed(conn, command))
        except BaseException:
            self.drop()
            raise
        return conn

    def read(self, conn: Any, name: str) -> Any:
        """The answer to the command :meth:`send` sent on ``conn``, as redis-py parses it."""
        try:
            return self._client.parse_response(conn, name)  # type: ignore[no-untyped-call]
        except rexc.ResponseError:  # answered: the connection is sound
            raise
        except BaseException:
            self.drop()
            raise

    def call(self, *command: Any) -> Any:
        """``command``'s answer."""
        return self.read(self.send(command), str(command[0]))

    def drop(self) -> None:
        """Disconnect this thread's connection (an answer may be left on it) and give it back."""
        kept: _Kept | None = getattr(self._local, "kept", None)
        self._local.kept = None
        if kept is not None and kept.pid == process_id():
            kept.drop()
