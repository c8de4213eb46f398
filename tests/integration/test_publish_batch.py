"""Batched publishing on a real Redis broker: a chunk is sent together, or none of it counts.

The broker is a private redis-server (``redis_server``), so a test can kill it
between the buffering of a chunk and its flush.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Producer

from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.dispatch.dispatcher import DISPATCH_CHUNK, Dispatcher
from celery_exactonce.dispatch.messages import GATED_OPTION, message_headers
from celery_exactonce.dispatch.outcomes import Outcome
from celery_exactonce.dispatch.publisher import CeleryPublisher, PublishFailed
from celery_exactonce.testing import InMemoryStore
from tests.integration.redis_server import RedisServer, redis_server

QUEUE = "batched"


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


def _app(server: RedisServer) -> Celery:
    app = Celery("batch", broker=server.url, set_as_current=False)
    app.conf.update(task_default_queue=QUEUE, broker_connection_retry=False)
    return app


def _scheduled(store: InMemoryStore, count: int, prefix: str) -> list[Job]:
    news = [
        NewJob(
            JobRef.submitted(f"{prefix}-{i}"),
            "t.plain",
            State.SCHEDULED,
            node="n",
            args=[i],
            options={GATED_OPTION: False},
        )
        for i in range(count)
    ]
    return [result.job for result in store.create_many(news) if result.job is not None]


def _queued(server: RedisServer) -> int:
    return int(redis.Redis.from_url(server.url).llen(QUEUE))


class KillBeforeFlush(CeleryPublisher):
    """Kills the broker just before the first flush (the chunk is buffered by then)."""

    def __init__(self, app: Any, server: RedisServer) -> None:
        super().__init__(app)
        self.server = server
        self.flushes = 0

    def flush(self) -> None:
        self.flushes += 1
        if self.flushes == 1:
            assert _queued(self.server) == 0  # buffered: nothing sent yet
            self.server.kill()
        super().flush()


def test_a_chunk_is_sent_at_its_flush_and_every_job_ends_published(server: RedisServer) -> None:
    store = InMemoryStore()
    listed = _scheduled(store, 2 * DISPATCH_CHUNK + 5, "ok")
    dispatcher = Dispatcher(store, CeleryPublisher(_app(server)), node="n")
    results = dispatcher.dispatch_many(listed)
    assert [r.outcome for r in results] == [Outcome.PUBLISHED] * len(listed)
    assert _queued(server) == len(listed)
    assert {store.get(job.ref).state for job in listed} == {State.PUBLISHED}  # type: ignore[union-attr]


def test_a_broker_lost_before_the_flush_publishes_nothing_and_claims_no_success(
    server: RedisServer,
) -> None:
    # Given a chunk whose messages are buffered when the broker dies
    store = InMemoryStore()
    listed = _scheduled(store, DISPATCH_CHUNK, "lost")
    app = _app(server)
    publisher = KillBeforeFlush(app, server)
    dispatcher = Dispatcher(store, publisher, node="n")
    # When the chunk is flushed
    results = dispatcher.dispatch_many(listed, retry=False)
    # Then no job is taken for published: each is rolled back (nothing was sent) or
    # ambiguous (kept DISPATCHED for the reconciler), all alike
    outcomes = {r.outcome for r in results}
    assert outcomes in ({Outcome.ROLLED_BACK}, {Outcome.AMBIGUOUS}), outcomes
    expected = State.SCHEDULED if outcomes == {Outcome.ROLLED_BACK} else State.DISPATCHED
    assert {store.get(job.ref).state for job in listed} == {expected}  # type: ignore[union-attr]
    # and once the broker is back, the same publisher sends the next chunk
    server.start()
    more = _scheduled(store, 3, "after")
    assert [r.outcome for r in dispatcher.dispatch_many(more)] == [Outcome.PUBLISHED] * 3
    assert _queued(server) == 3


def test_a_publish_outside_a_batch_is_sent_at_once_and_a_refused_one_is_definite(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One message (the one-write submit's) goes out at once, not through kombu's buffer."""
    store = InMemoryStore()
    (job,) = _scheduled(store, 1, "single")
    publisher = CeleryPublisher(_app(server))
    headers = message_headers(job, store.namespace)

    def buffered(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("a single publish went through kombu's publish buffer")

    monkeypatch.setattr(Producer, "batch", buffered)
    # When one message is published outside a batch, it is on the broker when the call returns
    publisher(job, headers, {})
    assert _queued(server) == 1
    # And with the broker gone, the publish fails definitely (nothing can have been sent)
    server.kill()
    with pytest.raises(PublishFailed) as failed:
        publisher(job, headers, {})
    assert failed.value.definite
