"""A message prepared, built then sent only when asked, on RabbitMQ (publisher confirms on)
and on Redis (kombu's commands captured, then sent as they are).

``CeleryPublisher.prepare`` is what the one-write submit builds while the
store's write is on the way. On the shared RabbitMQ and Redis, in a queue of
the test's own: preparing sends nothing, sending publishes exactly the
message the plain publish sends, and a queue declared already on the
connection is not declared (nor bound) again. On Redis, a send whose connect
is refused is a definite failure.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import kombu.messaging
import pytest
import redis
from celery import Celery
from kombu.exceptions import ChannelError

from celery_exactonce.core import jobs
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.dispatch import messages
from celery_exactonce.dispatch.capture import Captured
from celery_exactonce.dispatch.publisher import CeleryPublisher, PublishFailed
from tests import services

#: Per broker: its service, its URL and its transport options.
BROKERS = {
    "rabbitmq": ("rabbitmq", services.AMQP_URL, {"confirm_publish": True}),
    "redis": ("redis", services.REDIS_URL, {}),
    "redis-prefixed": ("redis", services.REDIS_URL, {"global_keyprefix": "pfx:"}),
}


@pytest.fixture(params=sorted(BROKERS))
def app(request: pytest.FixtureRequest) -> Iterator[Celery]:
    service, url, options = BROKERS[request.param]
    services.need(service)
    queue = f"prepare-{uuid.uuid4().hex[:12]}"
    app = Celery("prepare", broker=url, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        broker_transport_options=options,
        broker_connection_retry=False,
    )
    try:
        yield app
    finally:
        if service == "redis":
            services.delete_redis_keys(url, f"*{queue}*")
        else:
            with app.connection_for_write() as conn:
                conn.default_channel.queue_delete(queue)
        app.close()


def _job(job_id: str, **options: Any) -> Job:
    new = NewJob(
        JobRef.submitted(job_id),
        "t.add",
        State.SCHEDULED,
        node="n",
        args=[1, 2],
        options={messages.GATED_OPTION: True, **options},
    )
    now = datetime.now(timezone.utc)
    dispatch = Transition(State.DISPATCHED, frozenset({State.SCHEDULED}), node="n", reason="x")
    return jobs.apply_transition(jobs.job_from_new(new, now), dispatch, now)


def _waiting(app: Celery) -> list[Any]:
    """The messages in the app's queue, taken off it."""
    taken = []
    with app.connection_for_write() as conn:
        queue = kombu.Queue(app.conf.task_default_queue, channel=conn.default_channel)
        try:
            while (message := queue.get(no_ack=True)) is not None:
                taken.append(message)
        except ChannelError:  # never declared: nothing was ever published to it
            return []
    return taken


def test_a_prepared_message_is_sent_only_when_asked_and_as_the_plain_publish_sends_it(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    publisher = CeleryPublisher(app, timeout=10.0)
    first, second = _job("p1"), _job("p2")
    with publisher.batch(buffered=False):  # the plain way, sent at once
        publisher(first, messages.message_headers(first, "ns"), {})
        if _captured(app):  # a capture's own connection declares the queue at its first message
            warm = _job("p0")
            publisher.prepare(warm, messages.message_headers(warm, "ns"), {}).send()
        plain = [m for m in _waiting(app) if m.headers["id"] == "p1"]
        assert len(plain) == 1
        declares: list[Any] = []
        declare = kombu.messaging.maybe_declare

        def counted(entity: Any, *args: Any, **kwargs: Any) -> Any:
            declares.append(entity)
            return declare(entity, *args, **kwargs)

        monkeypatch.setattr(kombu.messaging, "maybe_declare", counted)
        prepared = publisher.prepare(second, messages.message_headers(second, "ns"), {})
        assert prepared.sent.id == "p2"
        assert _waiting(app) == []  # preparing sent nothing
        assert prepared.send() is prepared.sent
    # The queue was declared on the connection already: not again
    assert declares == []
    (sent,) = _waiting(app)
    # The same message but for the job's own fields
    for name in ("task", "exactonce_attempt", "retries", "expires", "eta"):
        assert sent.headers[name] == plain[0].headers[name], name
    assert sent.headers["id"] == "p2" and sent.headers["exactonce_job_id"] == "p2"
    assert sent.properties["delivery_mode"] == plain[0].properties["delivery_mode"]
    assert sent.delivery_info["routing_key"] == plain[0].delivery_info["routing_key"]


def _captured(app: Celery) -> bool:
    return str(app.conf.broker_url).startswith("redis")


def test_a_captured_message_whose_connect_is_refused_fails_definitely() -> None:
    # Given a message captured for a Redis broker whose address no longer answers
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    client = redis.Redis(port=port, socket_connect_timeout=5)
    captured = Captured("result", 0, (("lpush", "q", b"message"),), client)
    publisher = CeleryPublisher(Celery("refused", set_as_current=False))
    # When it is sent, the refused connect is a definite failure: nothing can have landed
    with pytest.raises(PublishFailed) as failed:
        publisher._push(captured)
    assert failed.value.definite and not failed.value.permanent


def test_a_message_that_cannot_be_built_fails_when_prepared_and_sends_nothing(
    app: Celery,
) -> None:
    publisher = CeleryPublisher(app)
    job = _job("p3", countdown="soon")  # Celery cannot make an eta of it
    with publisher.batch(), pytest.raises(PublishFailed) as failed:
        publisher.prepare(job, messages.message_headers(job, "ns"), {})
    assert failed.value.definite and failed.value.permanent
    assert _waiting(app) == []
