"""A connection each thread keeps for the store's own script calls.

redis-py's ``execute_command`` takes a connection from the pool and gives it
back for every command: a lock taken twice, the pool's metrics recorded four
times, and a ``poll`` of the socket to make sure nothing is left unread on it.
On a submit or a gate write, one script call each, that is a third of the
client's cost of the round trip. :class:`Lane` takes a connection from the
client's pool once per thread and keeps it: a call is the script sent and its
answer read, nothing else.

A kept connection is given back to the pool when its thread ends (or dropped
when the process forked: the pool then starts afresh by itself), and
disconnected and given back after any error but an answer (a ``ResponseError``
leaves the connection sound). Only for a plain client on redis-py's own
:class:`~redis.ConnectionPool` with real threads: not a cluster, not Sentinel
(whose pool follows a failover per connection taken), not a client that
retries by itself, not under an eventlet or gevent patch, where threads are
green and a connection per green thread would stay out of the pool for as long
as the thread lives; everything else takes redis-py's way.
"""

from __future__ import annotations

import _thread
import os
import threading
import weakref
from typing import Any

import redis
import redis.exceptions as rexc

from celery_exactonce.stores.redis.client import packed


class _Kept:
    """The connection one thread keeps; given back to the pool when the thread ends."""

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self.conn: Any = pool.get_connection()
        self.pid = os.getpid()
        self._given_back = weakref.finalize(self, pool.release, self.conn)

    def give_back(self, *, disconnect: bool) -> None:
        if disconnect:
            self.conn.disconnect()
        self._given_back()


class Lane:
    """Runs one command at a time on this thread's kept connection of ``client``'s pool."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._pool: redis.ConnectionPool = client.connection_pool
        self._local = threading.local()

    @staticmethod
    def suits(client: Any) -> bool:
        """Whether ``client`` can keep a connection per thread (see the module docs)."""
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
        if kept is None or kept.pid != os.getpid():  # none yet, or the parent's
            kept = self._local.kept = _Kept(self._pool)
        conn = kept.conn
        try:
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
        if kept is not None and kept.pid == os.getpid():
            kept.give_back(disconnect=True)
