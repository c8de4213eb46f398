"""The Redis store's enqueue: a record written ``DISPATCHED`` (with its message), atomically.

When the broker is a database on the store's own Redis server
(:meth:`RedisStore.shares_server <celery_exactonce.stores.redis.store.RedisStore.shares_server>`),
one script (``stores/redis/lua/enqueue.lua``) writes the record and runs the
broker commands of its publish: both exist or neither does. With a broker
elsewhere the same script writes the record alone, the one write before the
caller's publish; the caller may build its message while the script's answer
is on the way. Here:

* :class:`Push`: the broker commands of one publish, as kombu's Redis
  transport would run them (the publisher captures them);
* :class:`PushRefused`: Redis refused a broker command, or the script
  (an ACL): nothing was written;
* :class:`RedisEnqueue`, a base of
  :class:`~celery_exactonce.stores.redis.store.RedisStore`: the script's keys and
  arguments (the record as ``create`` writes it, with ``SCHEDULED →
  DISPATCHED`` already applied and both entries in its history, then each
  command's key, name and value), the call with the caller's work between
  sending it and reading its answer, and what its reply means.

Not here: :meth:`RedisStore.enqueue
<celery_exactonce.stores.redis.store.RedisStore.enqueue>` itself, which runs the
script (every operation of the store is defined on the class), how a
record's fields are encoded (:mod:`~celery_exactonce.stores.redis.codec`),
whether a broker's connection reaches the store's server
(:mod:`~celery_exactonce.stores.redis.client`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import redis.exceptions as rexc

from celery_exactonce.core import exceptions
from celery_exactonce.core.jobs import CreateResult, CreateStatus
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.stores import redact_secrets
from celery_exactonce.stores.base import Run
from celery_exactonce.stores.redis.base import RedisCore
from celery_exactonce.stores.redis.client import Lane, packed
from celery_exactonce.stores.redis.cluster import ClusterClient
from celery_exactonce.stores.redis.codec import as_text, decode_job, history_entry, record_fields


@dataclasses.dataclass(frozen=True)
class Push:
    """The broker commands of one publish, for a broker on the store's own Redis server.

    ``commands`` are ``(name, key, value)`` as kombu's Redis transport would run
    them (``lpush``, ``pexpire`` or ``publish``: the script refuses any other);
    ``db`` is the broker's database.
    """

    db: int
    commands: tuple[tuple[str, str, Any], ...]


class PushRefused(exceptions.StoreError):
    """Redis refused a broker command of :meth:`RedisStore.enqueue`: nothing was written."""


class RedisEnqueue(RedisCore):
    """The enqueue script's call (its answer awaited while the caller works) and reply."""

    #: ``enqueue`` takes ``meanwhile``: a function run while the script's answer is on the way.
    enqueue_overlaps = True

    def _run_meanwhile(self, keys: list[str], args: list[Any], meanwhile: Run = None) -> Any:
        """The ``enqueue`` script, ``meanwhile`` run between sending it and reading its answer.

        The call is written to a connection of the client's pool, ``meanwhile``
        runs, then the answer is read: the caller's work overlaps the round
        trip. Where the call is more than one command on one connection
        (``min_replicas``: its ``WAIT``; a cluster; a single-connection client)
        ``meanwhile`` runs first, then the call. ``meanwhile`` does not raise
        (if it does, the connection is dropped with the answer unread, and
        the outcome is unknown); it does not run if the call could not be sent.
        """
        if meanwhile is None:
            return self._run("enqueue", keys, args)
        client: Any = self._client
        pool: Any = getattr(client, "connection_pool", None)
        shared = getattr(client, "connection", None) is not None  # a single-connection client
        if self._counted or isinstance(client, ClusterClient) or pool is None or shared:
            meanwhile()
            return self._run("enqueue", keys, args)
        command = ("EVALSHA", self._scripts["enqueue"].sha, len(keys), *keys, *args)
        try:
            if self._lane is not None:  # this thread's kept connection
                return self._lane_meanwhile(self._lane, command, meanwhile)
            conn = pool.get_connection()
            try:
                conn.send_packed_command(packed(conn, command))
                meanwhile()
                return client.parse_response(conn, "EVALSHA")
            except rexc.ResponseError:  # answered: the connection is sound
                raise
            except BaseException:
                conn.disconnect()
                raise
            finally:
                pool.release(conn)
        except rexc.NoScriptError:  # a restarted or flushed server: the call did not run
            pass
        return self._run("enqueue", keys, args)  # loads the script, runs the call again

    @staticmethod
    def _lane_meanwhile(lane: Lane, command: tuple[Any, ...], meanwhile: Callable[[], None]) -> Any:
        """``command`` sent on ``lane``, ``meanwhile`` run, then its answer read."""
        conn = lane.send(command)
        try:
            meanwhile()
        except BaseException:
            lane.drop()  # the answer is left unread on it
            raise
        return lane.read(conn, "EVALSHA")

    def _enqueue_call(
        self, new: NewJob, dispatch: Transition, push: Push | None
    ) -> tuple[list[str], list[Any]]:
        """The ``enqueue`` script's keys and arguments; :class:`PushRefused` for a push
        without a command. No ``push``: the record alone (a broker elsewhere)."""
        if push is not None and not push.commands:
            raise PushRefused(f"enqueue of {new.ref}: no broker command")
        fields = record_fields(
            new, State.DISPATCHED.value, dispatch.new_rev, dispatch.node, dispatch.reason
        )
        keys = [self._job_key(new.ref), self._state_key(State.DISPATCHED)]
        created = history_entry(None, new.state.value, new.node, new.reason, new.rev)
        dispatched = history_entry(
            new.state.value,
            State.DISPATCHED.value,
            dispatch.node,
            dispatch.reason,
            dispatch.new_rev,
        )
        args: list[Any] = [
            self._db,
            self._db if push is None else push.db,
            "[" + created,
            '"},' + dispatched,
            len(fields) // 2,
            *fields,
        ]
        for name, key, value in push.commands if push is not None else ():
            keys.append(key)
            args += [name, value]
        return keys, args

    def _push_refused(self, what: str) -> PushRefused:
        """A :class:`PushRefused` naming this store, secrets blanked."""
        return PushRefused(redact_secrets(f"Redis store {self._where}: {what}", self._secrets))

    def _enqueued(self, reply: Any) -> CreateResult:
        """What the ``enqueue`` script answered: created, the record that exists, or refused."""
        status = as_text(reply[0])
        if status == "push_failed":
            raise self._push_refused(f"broker push refused: {as_text(reply[1])}")
        if status == "exists":
            return CreateResult(CreateStatus.EXISTS, decode_job(reply[1]))
        return CreateResult(CreateStatus.CREATED, None)
