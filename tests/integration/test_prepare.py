"""A message prepared on RabbitMQ (publisher confirms on): built, then sent only when asked.

``CeleryPublisher.prepare`` is what the one-write submit builds while the Redis
store's script is on the way. On the shared RabbitMQ, in a queue of the
test's own: preparing sends nothing, sending publishes exactly the message
the plain publish sends, and a queue declared already on the connection is
not declared (nor bound) again.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import kombu.messaging
import pytest
from celery import Celery
from kombu.exceptions import ChannelError

from celery_exactonce.core import jobs
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.dispatch import messages
from celery_exactonce.dispatch.publisher import CeleryPublisher, PublishFailed
from tests import services


@pytest.fixture
def app() -> Iterator[Celery]:
    services.need("rabbitmq")
    queue = f"prepare-{uuid.uuid4().hex[:12]}"
    app = Celery("prepare", broker=services.AMQP_URL, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        broker_transport_options={"confirm_publish": True},
        broker_connection_retry=False,
    )
    try:
        yield app
    finally:
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
    with publisher.batch():
        publisher(first, messages.message_headers(first, "ns"), {})  # the plain way
        declares: list[Any] = []
        declare = kombu.messaging.maybe_declare

        def counted(entity: Any, *args: Any, **kwargs: Any) -> Any:
            declares.append(entity)
            return declare(entity, *args, **kwargs)

        monkeypatch.setattr(kombu.messaging, "maybe_declare", counted)
        prepared = publisher.prepare(second, messages.message_headers(second, "ns"), {})
        assert prepared.sent.id == "p2"
        plain = _waiting(app)
        assert [m.headers["id"] for m in plain] == ["p1"]  # preparing sent nothing
        assert prepared.send() is prepared.sent
    # The queue was declared by the first publish on this connection: not again
    assert declares == []
    (sent,) = _waiting(app)
    # The same message but for the job's own fields
    for name in ("task", "exactonce_attempt", "retries", "expires", "eta"):
        assert sent.headers[name] == plain[0].headers[name], name
    assert sent.headers["id"] == "p2" and sent.headers["exactonce_job_id"] == "p2"
    assert sent.properties["delivery_mode"] == plain[0].properties["delivery_mode"]
    assert sent.delivery_info["routing_key"] == plain[0].delivery_info["routing_key"]


def test_a_message_that_cannot_be_built_fails_when_prepared_and_sends_nothing(
    app: Celery,
) -> None:
    publisher = CeleryPublisher(app)
    job = _job("p3", countdown="soon")  # Celery cannot make an eta of it
    with publisher.batch(), pytest.raises(PublishFailed) as failed:
        publisher.prepare(job, messages.message_headers(job, "ns"), {})
    assert failed.value.definite and failed.value.permanent
    assert _waiting(app) == []
