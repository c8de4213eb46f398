"""Capturing a Celery message without sending it: as the Redis commands kombu would run, or
as the producer's ``publish`` calls (:class:`Prepared`), made once the store's answer is in.

For the one-step submit: :meth:`~celery_exactonce.dispatch.publisher.CeleryPublisher.capture`
runs Celery's ``send_task`` on a :class:`CaptureChannel`, which collects
kombu's final Redis commands (the ``LPUSH`` to the routed queue...) instead
of sending them; the store then runs them in one script with the record
write. Only kombu's plain Redis transport, in a kombu whose publish batches
route a message into commands (5.7's ``PublishBatch``), can be captured
(:func:`redis_broker`). Not here: when to capture, and the general publish
(:mod:`~celery_exactonce.dispatch.publisher`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

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


@dataclasses.dataclass
class Capturing:
    """A capturing channel, its producer, and the broker's database and key prefix."""

    channel: CaptureChannel
    producer: Any
    db: int
    prefix: str


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
