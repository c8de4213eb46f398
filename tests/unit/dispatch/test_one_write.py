"""The one-write submit (``Dispatcher.enqueue`` on a store whose ``enqueue`` writes the record
alone, as the SQL stores' does): one store write, then the publish, and every failure."""

from __future__ import annotations

from typing import Any

import pytest

from celery_exactonce import StoreUnavailable
from celery_exactonce.core.jobs import CreateResult
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.dispatch.dispatcher import Dispatcher
from celery_exactonce.dispatch.publisher import PublishFailed
from celery_exactonce.dispatch.retrier import Retrier
from celery_exactonce.observe import metrics
from celery_exactonce.testing import InMemoryStore
from tests.support.helpers import poll, submitted
from tests.unit.dispatch.test_dispatcher import Broker


class OneWriteStore(InMemoryStore):
    """An in-memory store with a record-only ``enqueue``; counts its writes, loses answers."""

    def __init__(self, namespace: str) -> None:
        super().__init__(namespace)
        self.writes: list[str] = []
        self.lose: str | None = None  # "before" or "after" applying, once

    def enqueue(self, new: NewJob, dispatch: Transition) -> CreateResult:
        self.writes.append("enqueue")
        lose, self.lose = self.lose, None
        if lose == "before":
            raise StoreUnavailable("injected: nothing written")
        with self._lock:  # re-entrant: the create and its dispatch as one write
            result = InMemoryStore.create(self, new)
            if result.created:
                written = InMemoryStore.transition(self, new.ref, dispatch)
                result = CreateResult(result.status, written.job)
        if lose == "after":
            raise StoreUnavailable("injected: the answer was lost")
        return result

    def transition(self, ref: JobRef, request: Transition) -> Any:
        self.writes.append("transition")
        return super().transition(ref, request)

    def transition_many(self, requests: Any, *, brief: bool = False) -> Any:
        self.writes += ["transition"] * len(requests)
        return super().transition_many(requests, brief=brief)


@pytest.fixture(autouse=True)
def _counters() -> None:
    metrics.COUNTERS.reset()


_new = submitted


def test_one_write_then_the_publish_of_the_record_it_wrote() -> None:
    store, broker = OneWriteStore("ns"), Broker()
    enqueued = Dispatcher(store, broker, node="n").enqueue(_new(), reason="apply_async")
    assert enqueued is not None and enqueued.created
    assert store.writes == ["enqueue"]  # no DISPATCHED write of its own
    ((sent, headers),) = broker.sent
    stored = store.get(JobRef.submitted("w1"))
    assert stored is not None and stored.state is State.DISPATCHED and stored.dispatches == 1
    assert sent.rev == stored.rev and headers["exactonce_attempt"] == 0
    assert [(h.src, h.dst) for h in stored.history] == [
        (None, State.SCHEDULED),
        (State.SCHEDULED, State.DISPATCHED),
    ]


def test_a_job_that_exists_is_answered_and_nothing_is_published() -> None:
    store, broker = OneWriteStore("ns"), Broker()
    dispatcher = Dispatcher(store, broker, node="n")
    assert dispatcher.enqueue(_new()) is not None
    again = dispatcher.enqueue(_new())
    assert again is not None and not again.created and again.sent is None
    assert again.job.state is State.DISPATCHED and len(broker.sent) == 1


def test_plain_jobs_and_signed_stores_take_the_general_path() -> None:
    store, broker = OneWriteStore("ns"), Broker()
    assert Dispatcher(store, broker, node="n").enqueue(_new(gated=False)) is None
    assert store.writes == [] and broker.sent == []


def test_a_definite_publish_failure_rolls_back_and_the_retry_publishes_once() -> None:
    store, broker = OneWriteStore("ns"), Broker()
    broker.fault = PublishFailed("refused", definite=True)
    retrier = Retrier(first_delay=0.01, max_delay=0.05, give_up_after=10)
    dispatcher = Dispatcher(store, broker, node="n", retrier=retrier)
    enqueued = dispatcher.enqueue(_new())
    assert enqueued is not None and enqueued.created and enqueued.sent is None
    ref = JobRef.submitted("w1")
    assert store.get(ref).state is State.SCHEDULED  # type: ignore[union-attr]
    assert metrics.COUNTERS.get("publish_rolled_back") == 1
    broker.fault = None
    poll(lambda: store.get(ref).state is State.DISPATCHED)  # type: ignore[union-attr]
    poll(lambda: retrier.pending() == 0)
    assert len(broker.sent) == 1


def test_a_write_whose_answer_was_lost_is_read_back_and_published_once() -> None:
    store, broker = OneWriteStore("ns"), Broker()
    store.lose = "after"
    enqueued = Dispatcher(store, broker, node="n").enqueue(_new())
    assert enqueued is not None and enqueued.created and len(broker.sent) == 1


def test_a_write_that_did_not_apply_raises_for_the_caller_to_resubmit() -> None:
    store, broker = OneWriteStore("ns"), Broker()
    store.lose = "before"
    dispatcher = Dispatcher(store, broker, node="n")
    with pytest.raises(StoreUnavailable):
        dispatcher.enqueue(_new())
    assert store.get(JobRef.submitted("w1")) is None and broker.sent == []
    enqueued = dispatcher.enqueue(_new())  # resubmitted: created and published once
    assert enqueued is not None and enqueued.created and len(broker.sent) == 1
