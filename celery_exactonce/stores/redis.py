"""RedisStore: the job store in Redis, one Lua script per operation.

The key layout (every key of a namespace under ``{prefix}:{<namespace>}:``)
is :mod:`~celery_exactonce.stores.redis_keys`'s; how records, history entries
and the scripts' arguments and replies are encoded is
:mod:`~celery_exactonce.stores.redis_codec`'s; building the client from a URL,
naming its server and reading its config is
:mod:`~celery_exactonce.stores.redis_client`'s. All times are integer
microseconds since the UNIX epoch, read from Redis ``TIME`` inside the
scripts. Redis must run with ``maxmemory-policy noeviction``
(:meth:`RedisStore.check_config`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from importlib import resources
from typing import Any

import redis
import redis.exceptions as rexc

from celery_exactonce import exceptions, jobs, metrics
from celery_exactonce.jobs import (
    CreateResult,
    CreateStatus,
    Job,
    JobRef,
    NewJob,
    Transition,
    TransitionResult,
)
from celery_exactonce.states import TERMINAL, State
from celery_exactonce.stores import (
    redact_secrets,
    redact_url,
    url_secrets,
    validate_namespace,
)
from celery_exactonce.stores.base import FORMAT_VERSION
from celery_exactonce.stores.redis_client import (
    client_from_url,
    describe,
    maxmemory_policy,
    same_server,
)
from celery_exactonce.stores.redis_codec import (
    as_text,
    create_args,
    create_result,
    decode_job,
    history_entry,
    lease_ms,
    opt,
    record_fields,
    transition_args,
    transition_result,
)
from celery_exactonce.stores.redis_keys import RedisKeys, key_base

#: Errors after which retrying may help: the server is unreachable, slow,
#: loading, failing over or read-only (a replica promoted under us).
_TRANSIENT: tuple[type[Exception], ...] = (
    rexc.ConnectionError,
    rexc.TimeoutError,
    rexc.TryAgainError,
    rexc.ClusterDownError,
    rexc.MasterDownError,
    rexc.ReadOnlyError,
)
#: Server replies that mean the same though redis-py has no class for them.
_TRANSIENT_REPLIES = ("BUSY", "MASTERDOWN", "NOREPLICAS", "LOADING", "TRYAGAIN")

#: Jobs per call of a batch script (``create``, ``transition``): bounds how long one
#: call holds the server (a few milliseconds) while sparing most per-call costs.
SCRIPT_BATCH = 64

_SCRIPTS = (
    "create",
    "transition",
    "heartbeat",
    "annotate",
    "list_stale",
    "claim_due",
    "purge_expired",
    "epoch",
    "lease_acquire",
    "lease_renew",
    "lease_release",
    "setup",
    "enqueue",
)


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


def _lua_header() -> str:
    """The Python constants the scripts share, so Lua cannot drift from them."""
    states = ", ".join(f"'{s.value}'" for s in State)
    terminal = ", ".join(f"{s.value} = true" for s in State if s in TERMINAL)
    return (
        f"local STATES = {{{states}}}\n"
        f"local TERMINAL = {{{terminal}}}\n"
        f"local HISTORY_LIMIT = {jobs.HISTORY_LIMIT}\n"
    )


def _lua(name: str) -> str:
    lua = resources.files("celery_exactonce.stores").joinpath("lua")
    return lua.joinpath(f"{name}.lua").read_text(encoding="utf-8")


class RedisStore(RedisKeys):
    """A :class:`~celery_exactonce.stores.base.StateStore` in Redis.

    Parameters
    ----------
    client
        A ``redis.Redis`` client (``decode_responses`` either way). The store
        does not close a client it was given.
    namespace
        The namespace every key lives under (validated).
    retention
        Seconds a terminal record is kept, from ``max(fire_time, terminal_at)``.
    prefix
        The first part of every key (``exactonce_key_prefix``): 1-64 letters,
        digits, ``_``, ``.`` or ``-``.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        namespace: str,
        retention: float,
        prefix: str = "exactonce",
    ) -> None:
        validate_namespace(namespace)
        base = key_base(prefix, namespace)
        if retention <= 0:
            raise exceptions.ConfigurationError("retention must be > 0", setting="retention")
        self._client = client
        self._namespace = namespace
        self._retention = float(retention)
        self._retention_us = int(retention * 1_000_000)
        self._base = base
        # The namespace's fixed keys, built once: every script call passes several.
        self._index_keys = [self._state_key(state) for state in State]
        self._due_key, self._expire_key = self._key("due"), self._key("expire")
        self._owns_client = False
        self._closed = False
        self._db, self._where, self._secrets = describe(client)
        header = _lua_header() + _lua("common")
        self._scripts = {name: client.register_script(header + _lua(name)) for name in _SCRIPTS}

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        namespace: str,
        retention: float,
        prefix: str = "exactonce",
        socket_timeout: float = 5.0,
        **kwargs: Any,
    ) -> RedisStore:
        """A store on a new client for ``url`` (``redis://``, ``rediss://``, ``unix://``).

        The client does not retry commands by itself (``retry`` may be passed):
        a script resent after a timeout could apply twice and answer as if
        another writer had won, where the caller must instead settle the
        unknown outcome by reading the record back.
        """
        client = client_from_url(url, socket_timeout, kwargs)
        store = cls(client, namespace=namespace, retention=retention, prefix=prefix)
        store._owns_client = True
        store._where = redact_url(url)
        store._secrets += url_secrets(url)
        return store

    def __repr__(self) -> str:
        return f"RedisStore({self._where}, namespace={self._namespace!r})"

    # -- properties and housekeeping ---------------------------------------------------

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def retention(self) -> float:
        return self._retention

    def now(self) -> datetime:
        with self._wrap("TIME"):
            seconds, micros = self._client.time()
        return jobs.from_micros(int(seconds) * 1_000_000 + int(micros))

    def ping(self) -> bool:
        """Whether Redis answers (raises :class:`StoreUnavailable` when it does not)."""
        with self._wrap("PING"):
            return bool(self._client.ping())

    def setup(self) -> None:
        with self._wrap("setup"):
            stored = self._run("setup", [self._key("meta")], [FORMAT_VERSION, self._namespace])
        version = as_text(stored)
        if not version.isdigit() or int(version) > FORMAT_VERSION:
            raise exceptions.SchemaMismatch(
                f"Redis store {self._where}, namespace {self._namespace!r}: key format "
                f"{version!r} is not one this version reads (it writes {FORMAT_VERSION}); "
                "upgrade celery-exactonce"
            )

    def check_config(self) -> None:
        """Refuse a Redis that may evict keys (``maxmemory-policy`` other than ``noeviction``).

        Reads ``CONFIG GET``, or ``INFO memory`` when ``CONFIG`` is disabled or
        renamed; when neither is readable, logs a warning and passes.
        """
        with self._wrap("check_config"):
            policy = maxmemory_policy(self._client)
        if policy is None:
            metrics.event(
                "store_config_unknown",
                f"cannot read maxmemory-policy of Redis store {self._where}; it must be noeviction",
                level=logging.WARNING,
            )
        elif policy != "noeviction":
            raise exceptions.ConfigurationError(
                f"exactonce_store_url={self._where!r}: Redis maxmemory-policy is {policy!r}; "
                "it must be 'noeviction' (an evicted record could let a job run twice)",
                setting="exactonce_store_url",
            )

    def drop_namespace(self) -> None:
        """Delete every key of this namespace (records, indexes, epoch, leases, meta)."""
        pattern = f"{self._base}:*"
        with self._wrap("drop_namespace"):
            batch: list[Any] = []
            for key in self._client.scan_iter(match=pattern, count=500):
                batch.append(key)
                if len(batch) >= 500:
                    self._client.delete(*batch)
                    batch = []
            if batch:
                self._client.delete(*batch)

    def close(self) -> None:
        if not self._closed and self._owns_client:
            with contextlib.suppress(rexc.RedisError, OSError):
                self._client.close()
                self._client.connection_pool.disconnect()
        self._closed = True

    # -- epoch and create ----------------------------------------------------------------

    def epoch(self, *, replace: str | None = None) -> str:
        args = [jobs.new_token(), opt(replace)]
        with self._wrap("epoch"):
            return as_text(self._run("epoch", [self._key("epoch")], args))

    def create(self, new: NewJob, *, epoch: str | None = None) -> CreateResult:
        with self._wrap("create"):
            return create_result(self._run_batched("create", *self._create_batch([new], epoch))[0])

    def create_many(
        self, news: Sequence[NewJob], *, epoch: str | None = None, brief: bool = False
    ) -> list[CreateResult]:
        """One pipelined round trip of ``create`` calls, each job created atomically."""
        batch = self._create_batch(news, epoch, brief)
        with self._wrap("create_many"):
            return [create_result(reply) for reply in self._run_batched("create", *batch)]

    def _create_batch(
        self, news: Sequence[NewJob], epoch: str | None, brief: bool = False
    ) -> tuple[list[Any], list[Any], list[tuple[list[str], list[Any]]]]:
        """The ``create`` script's shared keys and arguments, and each job's."""
        shared_keys = [self._key("epoch"), self._key("wm"), self._due_key, *self._index_keys]
        return (
            shared_keys,
            [opt(epoch), "1" if brief else "0"],
            [self._create_item(new) for new in news],
        )

    def _create_item(self, new: NewJob) -> tuple[list[str], list[Any]]:
        return [self._job_key(new.ref)], create_args(new)

    # -- create and enqueue (a broker on this server) ------------------------------------

    def shares_server(self, connection_kwargs: Mapping[str, Any]) -> int | None:
        """This store's database if ``connection_kwargs`` (redis-py's) reach its server; else None.

        The same host and port (or unix socket) as this store's client, which
        must be a plain client (a cluster has no databases, and a script there
        may only touch its own slot): then :meth:`enqueue` can push to that
        server's broker database.
        """
        return self._db if same_server(self._client, connection_kwargs) else None

    def enqueue(self, new: NewJob, dispatch: Transition, push: Push) -> CreateResult:
        """Create ``new`` straight into ``DISPATCHED`` and run ``push``, atomically.

        ``new`` (``SCHEDULED``) is written with ``dispatch`` (``SCHEDULED →
        DISPATCHED``) already applied, both in its history, in the same script
        that runs the broker commands: the record and the message exist together
        or not at all. ``CREATED`` (``job`` unset: the caller knows the record),
        or ``EXISTS`` with the record and nothing pushed. :class:`PushRefused`
        when Redis refused a broker command (nothing written). Any other error
        leaves the outcome unknown: read back ``dispatch.new_rev``.
        """
        if not push.commands:
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
            push.db,
            "[" + created,
            '"},' + dispatched,
            len(fields) // 2,
            *fields,
        ]
        for name, key, value in push.commands:
            keys.append(key)
            args += [name, value]
        with self._wrap("enqueue"):
            try:
                reply = self._run("enqueue", keys, args)
            except rexc.NoPermissionError as exc:  # an ACL refused the call: it did not run
                raise PushRefused(
                    redact_secrets(
                        f"Redis store {self._where}: enqueue refused: {exc}", self._secrets
                    )
                ) from exc
        status = as_text(reply[0])
        if status == "push_failed":
            raise PushRefused(
                redact_secrets(
                    f"Redis store {self._where}: broker push refused: {as_text(reply[1])}",
                    self._secrets,
                )
            )
        if status == "exists":
            return CreateResult(CreateStatus.EXISTS, decode_job(reply[1]))
        return CreateResult(CreateStatus.CREATED, None)

    def get(self, ref: JobRef) -> Job | None:
        with self._wrap("get"):
            record = dict(self._client.hgetall(self._job_key(ref)))
        return decode_job([item for pair in record.items() for item in pair]) if record else None

    def watermark(self, entry: str) -> datetime | None:
        return self.watermarks([entry]).get(entry)

    def watermarks(self, entries: Sequence[str]) -> dict[str, datetime]:
        if not entries:
            self._check_open()
            return {}
        with self._wrap("watermarks"):
            marks = self._client.hmget(self._key("wm"), list(entries))
        return {
            entry: jobs.from_micros(int(as_text(mark)))
            for entry, mark in zip(entries, marks, strict=True)
            if mark is not None
        }

    # -- transitions ---------------------------------------------------------------------

    def transition(self, ref: JobRef, request: Transition) -> TransitionResult:
        with self._wrap("transition"):
            reply = self._run_batched("transition", *self._transition_batch([(ref, request)]))
        return transition_result(reply[0])

    def transition_many(
        self, requests: Sequence[tuple[JobRef, Transition]], *, brief: bool = False
    ) -> list[TransitionResult]:
        """One pipelined round trip of ``transition`` calls, each job's CAS atomic."""
        batch = self._transition_batch(requests, brief)
        with self._wrap("transition_many"):
            return [transition_result(reply) for reply in self._run_batched("transition", *batch)]

    def _transition_batch(
        self, requests: Sequence[tuple[JobRef, Transition]], brief: bool = False
    ) -> tuple[list[Any], list[Any], list[tuple[list[str], list[Any]]]]:
        """The ``transition`` script's shared keys and arguments, and each job's."""
        shared_keys = [*self._index_keys, self._due_key, self._expire_key]
        shared_args = [self._retention_us, "1" if brief else "0"]
        return shared_keys, shared_args, [self._transition_item(*pair) for pair in requests]

    def _transition_item(self, ref: JobRef, request: Transition) -> tuple[list[str], list[Any]]:
        lease = request.lease
        keys = [
            self._job_key(ref),
            self._key("lease", lease.name) if lease else self._key("nolease"),
        ]
        return keys, transition_args(ref, request)

    def heartbeat(self, ref: JobRef, run_id: str) -> bool:
        keys = [self._job_key(ref), self._state_key(State.RUNNING)]
        with self._wrap("heartbeat"):
            return bool(self._run("heartbeat", keys, [run_id, str(ref)]))

    def annotate(self, ref: JobRef, *, node: str, reason: str, op_id: str) -> bool:
        reason = jobs.check_note(node, reason, op_id)
        with self._wrap("annotate"):
            return bool(self._run("annotate", [self._job_key(ref)], [node, reason, op_id]))

    # -- queries and sweeps --------------------------------------------------------------

    def list_stale(
        self,
        state: State,
        older_than: float,
        limit: int,
        *,
        after: tuple[datetime, JobRef] | None = None,
    ) -> list[Job]:
        if limit <= 0:
            self._check_open()
            return []
        # As the in-memory store: the age rounded to microseconds by timedelta.
        age = timedelta(seconds=older_than) // timedelta(microseconds=1)
        keys = [self._state_key(State(state)), self._key("job", "")]
        # The cursor is the index's own (score, member) of the previous page's last job.
        at, member = (None, None) if after is None else (jobs.to_micros(after[0]), after[1])
        args = [age, limit, opt(at), opt(member)]
        with self._wrap("list_stale"):
            records = self._run("list_stale", keys, args)
        return [decode_job(flat) for flat in records]

    def claim_due(self, limit: int, *, node: str, reason: str = "claimed") -> list[Job]:
        jobs.validate_identifier(node, "node id", jobs.MAX_NAME_LENGTH)
        jobs.validate_reason(reason)
        if limit <= 0:
            self._check_open()
            return []
        keys = [
            self._key("due"),
            self._state_key(State.PENDING),
            self._state_key(State.SCHEDULED),
            self._key("job", ""),
        ]
        with self._wrap("claim_due"):
            records = self._run("claim_due", keys, [limit, jobs.new_token(), node, reason])
        return [decode_job(flat) for flat in records]

    def purge_expired(self, limit: int) -> int:
        if limit <= 0:
            self._check_open()
            return 0
        keys = [self._key("expire"), self._key("due"), self._key("job", ""), *self._state_keys()]
        with self._wrap("purge_expired"):
            return int(self._run("purge_expired", keys, [limit]))

    # -- leases --------------------------------------------------------------------------

    def acquire_lease(self, name: str, token: str, ttl: float) -> bool:
        jobs.Lease(name, token)  # validates
        with self._wrap("acquire_lease"):
            return bool(
                self._run("lease_acquire", [self._key("lease", name)], [token, lease_ms(ttl)])
            )

    def renew_lease(self, name: str, token: str, ttl: float) -> bool:
        with self._wrap("renew_lease"):
            return bool(
                self._run("lease_renew", [self._key("lease", name)], [token, lease_ms(ttl)])
            )

    def release_lease(self, name: str, token: str) -> bool:
        with self._wrap("release_lease"):
            return bool(self._run("lease_release", [self._key("lease", name)], [token]))

    # -- internals -----------------------------------------------------------------------

    def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """Run script ``name``: EVALSHA, and on a server that lacks it, load it and run it again.

        What redis-py's ``Script.__call__`` does, without the import and tuple
        copies it makes per call (a submit runs one script).
        """
        script, execute = self._scripts[name], self._client.execute_command
        try:
            return execute("EVALSHA", script.sha, len(keys), *keys, *args)  # type: ignore[no-untyped-call]
        except rexc.NoScriptError:  # a restarted or flushed server: the call did not run
            script.sha = self._client.script_load(script.script)
            return execute("EVALSHA", script.sha, len(keys), *keys, *args)  # type: ignore[no-untyped-call]

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
        replies = self._evalsha_many(script.sha, calls)
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, rexc.NoScriptError)]
        if missing:  # a restarted or flushed server: those calls did not run; load, run them
            script.sha = self._client.script_load(script.script)
            retried = self._evalsha_many(script.sha, [calls[i] for i in missing])
            for i, reply in zip(missing, retried, strict=True):
                replies[i] = reply
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    def _evalsha_many(self, sha: str, calls: Sequence[tuple[list[str], list[Any]]]) -> list[Any]:
        """EVALSHA per call in one pipeline; errors come back as values.

        Not ``Script.__call__`` on the pipeline: that costs a ``SCRIPT EXISTS``
        round trip per batch, where a missing script is rare and shows as
        ``NoScriptError`` replies (the call did not run) that :meth:`_run_many` handles.
        """
        with self._client.pipeline(transaction=False) as pipe:
            for keys, args in calls:
                pipe.evalsha(sha, len(keys), *keys, *args)
            return list(pipe.execute(raise_on_error=False))

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
            message = redact_secrets(
                f"Redis store {self._where}: {action} failed: {type(exc).__name__}: {exc}",
                self._secrets,
            )
            transient = isinstance(exc, _TRANSIENT) or (
                isinstance(exc, rexc.ResponseError) and str(exc).startswith(_TRANSIENT_REPLIES)
            )
            error = exceptions.StoreUnavailable if transient else exceptions.StoreError
            raise error(message) from exc
        except UnicodeError as exc:  # an identifier redis-py cannot encode (lone surrogate)
            raise exceptions.InvalidPayload(f"{action}: {exc}") from exc
