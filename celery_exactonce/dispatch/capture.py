"""Capturing a Celery message without sending it: as the Redis commands kombu would run, or
as the producer's ``publish`` calls (:class:`Prepared`), made once the store's answer is in.

:meth:`~celery_exactonce.dispatch.publisher.CeleryPublisher.capture` runs
Celery's ``send_task`` on a :class:`CaptureChannel`, which collects kombu's
final Redis commands (the ``LPUSH`` to the routed queue...) instead of
sending them. For the one-step submit the store runs them in one script with
the record write; for the one-write submit they are built while the store's
write is on the way and sent as they are once it answered (:func:`push`).
Only kombu's plain Redis transport, in a kombu whose publish batches route a
message into commands (5.7's ``PublishBatch``), can be captured
(:func:`redis_broker`); on any other, the producer's ``publish`` calls are kept
(:class:`KeptProducer`). Not here: when to capture, and the general publish
(:mod:`~celery_exactonce.dispatch.publisher`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Any

from celery_exactonce.core.refs import process_id

#: kombu's Redis commands of a publish that an atomic enqueue runs (``PublishBatch.add``).
PUSH_COMMANDS = frozenset({"lpush", "pexpire", "publish"})


@dataclasses.dataclass(frozen=True)
class Captured:
    """A message built by :meth:`CeleryPublisher.capture`, not sent."""

    #: What ``send_task`` returned (its ``AsyncResult``).
    sent: Any
    #: The broker's Redis database.
    db: int
    #: kombu's Redis commands for it, ``(name, key, value)``, in order, each key
    #: with the broker's ``global_keyprefix`` as kombu's client would send it.
    commands: tuple[tuple[str, str, Any], ...]
    #: A client of the broker's Redis that sends :attr:`commands` as they are (:func:`push`).
    client: Any = None


@dataclasses.dataclass
class Capturing:
    """A capturing channel, its producer, the broker's database and key prefix, and a
    client of the broker's Redis that adds no prefix."""

    channel: CaptureChannel
    producer: Any
    db: int
    prefix: str
    client: Any


#: Where the broker must be for a capture: on the store's server (what the store's
#: ``shares_server`` says of a host, port and socket: its database, or ``None``), or anywhere.
Where = Callable[[Mapping[str, Any]], int | None] | None


class Captures:
    """The capturing channels of one app in this process, for captures made anywhere or on
    the store's server.

    Kept in free lists (:meth:`give` gives one back), each on a connection of
    its own used to declare queues and look bindings up, never to publish:
    acquiring a producer from the pool and binding it anew would cost a good
    share of a publish. There are as many as calls were ever capturing at
    once, which send nothing and so hardly ever wait. Whether the broker can
    be captured is decided once per process and kind, but for a broker that
    is down (not this time).
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self._lock = threading.Lock()
        self._pid = process_id()
        #: Per kind (``True``: on the store's server), the free channels and whether the
        #: broker can be captured (absent: not known yet).
        self._free: dict[bool, list[Capturing]] = {True: [], False: []}
        self._possible: dict[bool, bool] = {}

    def __len__(self) -> int:
        """The capturing channels this process keeps, free."""
        with self._lock:
            return sum(len(free) for free in self._free.values())

    def possible(self, *, shared: bool) -> bool:
        """Whether :meth:`take` may answer one, for a broker on the store's server (``shared``)
        or anywhere: ``False`` once this process found it cannot."""
        return self._pid != process_id() or self._possible.get(shared) is not False

    def take(self, where: Where) -> Capturing | None:
        """A capturing channel for a broker ``where`` says suits, or ``None``: not capturable."""
        kind = where is not None
        with self._lock:
            # A forked child: its parent's connections are not its own.
            if self._pid != process_id():
                self._free, self._possible = {True: [], False: []}, {}
                self._pid = process_id()
            if self._possible.get(kind) is False:
                return None
            if self._free[kind]:
                return self._free[kind].pop()
        connection = self.app.connection_for_write()
        try:
            target = self._open(connection, where)
        except Exception:  # it connects: a broker that is down is left to the general path
            connection.release()  # this time
            return None
        if target is None:
            connection.release()
            self._possible[kind] = False
        return target

    def _open(self, connection: Any, where: Where) -> Capturing | None:
        place = {"host": connection.hostname, "port": connection.port, "path": None}
        if connection.transport.driver_type != "redis" or (where and where(place) is None):
            return None
        real = connection.default_channel
        broker = redis_broker(real)
        if broker is None or (where and where(real.pool.connection_kwargs) is None):
            return None
        import redis

        capture = CaptureChannel(real)
        producer = self.app.amqp.Producer(capture)
        producer.maybe_declare = declared_once(producer)
        return Capturing(capture, producer, *broker, redis.Redis(connection_pool=real.pool))

    def give(self, target: Capturing, where: Where) -> None:
        """Give back a channel :meth:`take` answered for ``where``."""
        with self._lock:
            if self._pid == process_id():
                self._free[where is not None].append(target)


def push(captured: Captured) -> None:
    """Send ``captured``'s commands to the broker's Redis: one alone, several as kombu's own
    publish sends them (one ``MULTI``/``EXEC``)."""
    if len(captured.commands) == 1:
        ((name, key, value),) = captured.commands
        captured.client.execute_command(name.upper(), key, value)
        return
    with captured.client.pipeline() as pipe:
        for name, key, value in captured.commands:
            pipe.execute_command(name.upper(), key, value)
        pipe.execute()


def redis_broker(channel: Any) -> tuple[int, str] | None:
    """The database and key prefix of a kombu Redis channel whose commands can be captured.

    Only kombu's plain Redis transport (not Sentinel's), in a kombu whose
    publish batches route a message into commands (``PublishBatch``, kombu
    5.7). A ``global_keyprefix`` is what kombu's client would put before the
    key of each command as it sends it: the capture puts it there itself, for
    the commands kombu's client prefixes that way (else ``None``).
    """
    try:
        from kombu.transport import redis as kombu_redis
    except ImportError:  # pragma: no cover - redis-py is a dependency
        return None
    if type(channel) is not kombu_redis.Channel or not hasattr(kombu_redis, "PublishBatch"):
        return None
    prefix = str(getattr(channel, "global_keyprefix", "") or "")
    if prefix:
        prefixed = getattr(kombu_redis, "GlobalKeyPrefixMixin", None)
        simple = {name.lower() for name in getattr(prefixed, "PREFIXED_SIMPLE_COMMANDS", ())}
        if not simple >= PUSH_COMMANDS:
            return None
    return int(channel.pool.connection_kwargs.get("db") or 0), prefix


def declared(producer: Any, entity: Any) -> bool:
    """Whether ``entity`` is declared already on ``producer``'s connection (kombu's cache)."""
    connection = producer.channel.connection
    return bool(
        entity
        and connection is not None
        and entity.can_cache_declaration
        and hash(entity) in connection.client.declared_entities
    )


def declared_once(producer: Any) -> Callable[..., Any]:
    """``producer.maybe_declare``, answering an entity already declared on its connection at once.

    kombu's own answers the same (``False``, nothing declared) after binding a
    copy of the entity to the channel, which it throws away: for a queue and
    its exchange, a tenth of building a message. Anything not declared yet
    goes to kombu's.
    """
    declare = producer.maybe_declare

    def maybe_declare(entity: Any, retry: bool = False, **retry_policy: Any) -> Any:
        if declared(producer, entity):
            return False
        return declare(entity, retry, **retry_policy)

    return maybe_declare


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A message :meth:`CeleryPublisher.prepare` built: the producer calls that send it."""

    #: What ``send_task`` returned (its ``AsyncResult``).
    sent: Any
    #: The ``publish`` calls ``send_task`` made on its producer (the message, then any
    #: ``task-sent`` event), as ``(args, kwargs)``, not made yet.
    calls: tuple[tuple[tuple[Any, ...], dict[str, Any]], ...]
    #: Makes :attr:`calls` on this thread's batch producer; returns :attr:`sent`.
    send: Callable[[], Any]


class KeptProducer:
    """A producer whose ``publish`` calls are kept, not made; the rest is ``producer``'s."""

    def __init__(self, producer: Any) -> None:
        self.producer = producer
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def publish(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append((args, kwargs))

    def replay(self, producer: Any) -> None:
        """Make the kept calls on ``producer``, but declaring what is declared on its
        connection already (kombu's ``maybe_declare`` would only bind a copy of it)."""
        for args, kwargs in self.calls:
            declare = [e for e in kwargs.get("declare") or () if not declared(producer, e)]
            producer.publish(*args, **{**kwargs, "declare": declare})

    def __getattr__(self, name: str) -> Any:
        return getattr(self.producer, name)


class CaptureChannel:
    """A kombu Redis channel that turns a publish into commands and sends none.

    Everything but the publish is the real channel's (declaring a queue,
    looking an exchange's bindings up). A publish goes to the real channel's
    ``basic_publish`` with this channel as its ``_publish_batch`` (kombu
    5.7's ``PublishBatch`` protocol): kombu's Redis transport then hands the
    commands it would run to :meth:`add` instead of running them. A
    producer's own batches are off (``supports_batch_publish``), so every
    publish comes here.
    """

    supports_batch_publish = False

    def __init__(self, channel: Any) -> None:
        self.real = channel
        self.commands: list[tuple[Any, ...]] = []

    def basic_publish(self, message: Any, **kwargs: Any) -> Any:
        return self.real.basic_publish(message, _publish_batch=self, **kwargs)

    def add(self, name: str, *args: Any) -> None:
        self.commands.append((name, *args))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)
