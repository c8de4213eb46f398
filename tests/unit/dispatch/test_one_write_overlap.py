"""The one-write submit on a store that overlaps its write (``enqueue_overlaps``: the Redis
store): the message is built while the write's answer is on the way, and sent only after it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

from celery_exactonce import StoreUnavailable
from celery_exactonce.core.jobs import CreateResult, Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.dispatch.capture import Prepared
from celery_exactonce.dispatch.dispatcher import Dispatcher
from celery_exactonce.dispatch.publisher import PublishFailed
from celery_exactonce.observe import metrics
from tests.unit.dispatch.test_dispatcher import Broker
from tests.unit.dispatch.test_one_write import OneWriteStore, _new


class OverlapStore(OneWriteStore):
    """A record-only ``enqueue`` that runs ``meanwhile`` between sending and answering."""

    enqueue_overlaps = True

    def __init__(self, namespace: str, events: list[str]) -> None:
        super().__init__(namespace)
        self.events = events

    def enqueue(  # type: ignore[override]
        self, new: NewJob, dispatch: Transition, *, meanwhile: Callable[[], None] | None = None
    ) -> CreateResult:
        if self.lose == "before":  # the call could not be sent: nothing ran, meanwhile neither
            return super().enqueue(new, dispatch)
        self.events.append("write sent")
        if meanwhile is not None:
            meanwhile()
        result = super().enqueue(new, dispatch)
        self.events.append("answer read")
        return result


class PreparingBroker(Broker):
    """A publisher that builds a message without sending it (``prepare``), as Celery's does."""

    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events
        self.build_fault: PublishFailed | None = None
        self.depth = 0

    @contextlib.contextmanager
    def batch(self, *, buffered: bool = True) -> Iterator[None]:
        """One producer for the block (a nested block uses the outer one's), as Celery's."""
        self.depth += 1
        if self.depth == 1:
            self.events.append("producer taken" if buffered else "producer taken, unbuffered")
        try:
            yield
        finally:
            self.depth -= 1
            if not self.depth:
                self.events.append("producer given back")

    def prepare(
        self,
        job: Job,
        headers: Mapping[str, Any],
        extra: Mapping[str, Any],
        held: contextlib.ExitStack,
    ) -> Prepared:
        """On a producer of its own, held until the message is sent (Celery's kept path)."""
        held.enter_context(self.batch(buffered=False))
        if self.build_fault is not None:
            raise self.build_fault
        self.events.append("built")
        result = f"result of {job.ref.id}"

        def send() -> str:
            self(job, headers, extra)
            self.events.append("published")
            return result

        return Prepared(result, (), send)


@pytest.fixture(autouse=True)
def _counters() -> None:
    metrics.COUNTERS.reset()


@pytest.fixture
def events() -> list[str]:
    return []


@pytest.fixture
def store(events: list[str]) -> OverlapStore:
    return OverlapStore("ns", events)


@pytest.fixture
def broker(events: list[str]) -> PreparingBroker:
    return PreparingBroker(events)


def test_the_message_is_built_while_the_write_is_on_the_way_and_sent_after_its_answer(
    store: OverlapStore, broker: PreparingBroker, events: list[str]
) -> None:
    enqueued = Dispatcher(store, broker, node="n").enqueue(_new(), reason="apply_async")
    assert enqueued is not None and enqueued.created
    assert events == [
        "write sent",
        "producer taken, unbuffered",
        "built",
        "answer read",
        "published",
        "producer given back",
    ]
    assert store.writes == ["enqueue"] and enqueued.sent == "result of w1"
    ((sent, headers),) = broker.sent
    stored = store.get(JobRef.submitted("w1"))
    assert stored is not None and stored.state is State.DISPATCHED
    # The message built from this process's estimate is the record's: its rev, our headers
    assert sent.rev == stored.rev and headers["exactonce_job_id"] == "w1"
    assert headers["idempotency_key"] and headers["exactonce_attempt"] == 0


def test_a_job_that_exists_gets_no_message_and_its_result_is_the_one_built(
    store: OverlapStore, broker: PreparingBroker, events: list[str]
) -> None:
    dispatcher = Dispatcher(store, broker, node="n")
    assert dispatcher.enqueue(_new()) is not None
    events.clear()
    again = dispatcher.enqueue(_new())
    assert again is not None and not again.created and again.sent == "result of w1"
    assert events == [
        "write sent",
        "producer taken, unbuffered",
        "built",
        "answer read",
        "producer given back",
    ]
    assert len(broker.sent) == 1


@pytest.mark.parametrize(
    ("fault", "state", "counter"),
    [
        (PublishFailed("bad option", definite=True, permanent=True), State.FAILED, None),
        (PublishFailed("refused", definite=True), State.SCHEDULED, "publish_rolled_back"),
    ],
    ids=["cannot-be-built", "connect-refused"],
)
def test_a_message_that_could_not_be_built_fails_as_its_publish_would(
    store: OverlapStore,
    broker: PreparingBroker,
    fault: PublishFailed,
    state: State,
    counter: str | None,
) -> None:
    broker.build_fault = fault
    enqueued = Dispatcher(store, broker, node="n").enqueue(_new())
    assert enqueued is not None and enqueued.created and enqueued.sent is None
    assert broker.sent == []
    stored = store.get(JobRef.submitted("w1"))
    assert stored is not None and stored.state is state
    if counter is not None:
        assert metrics.COUNTERS.get(counter) == 1


def test_an_answer_lost_is_read_back_and_the_message_built_is_sent_once(
    store: OverlapStore, broker: PreparingBroker, events: list[str]
) -> None:
    store.lose = "after"
    enqueued = Dispatcher(store, broker, node="n").enqueue(_new())
    assert enqueued is not None and enqueued.created and enqueued.sent == "result of w1"
    assert events == [
        "write sent",
        "producer taken, unbuffered",
        "built",
        "published",
        "producer given back",
    ]
    assert len(broker.sent) == 1


def test_a_call_that_could_not_be_sent_builds_nothing_and_raises(
    store: OverlapStore, broker: PreparingBroker, events: list[str]
) -> None:
    store.lose = "before"
    with pytest.raises(StoreUnavailable):
        Dispatcher(store, broker, node="n").enqueue(_new())
    assert events == [] and broker.sent == []  # no producer taken either
    assert store.get(JobRef.submitted("w1")) is None
