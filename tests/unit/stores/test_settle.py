"""Settling a write whose answer was lost (``stores/settle.py``): read back, then decide."""

from __future__ import annotations

from typing import Any

import pytest

from celery_exactonce.core.exceptions import StoreUnavailable
from celery_exactonce.core.jobs import CreateStatus, TransitionStatus
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.stores import settle
from celery_exactonce.stores.settle import Decision
from celery_exactonce.testing import InMemoryStore

REF = JobRef.submitted("j1")


class LossyStore(InMemoryStore):
    """Writes that apply (``lose``) or not (``refuse``) and then raise; reads that fail."""

    def __init__(self) -> None:
        super().__init__("settle")
        self.writes: list[str] = []
        self.failed_gets = 0
        self.gets = 0

    def _write(self, apply: Any) -> Any:
        step = self.writes.pop(0) if self.writes else "ok"
        if step == "refuse":
            raise StoreUnavailable("injected: refused")
        answer = apply()
        if step == "lose":
            raise StoreUnavailable("injected: applied, answer lost")
        return answer

    def transition(self, ref, request):  # type: ignore[no-untyped-def]
        return self._write(lambda: super(LossyStore, self).transition(ref, request))

    def create_many(self, news, *, epoch=None, brief=False):  # type: ignore[no-untyped-def]
        return self._write(lambda: [super(LossyStore, self).create(new) for new in news])

    def create(self, new, *, epoch=None):  # type: ignore[no-untyped-def]
        return self._write(lambda: super(LossyStore, self).create(new, epoch=epoch))

    def get(self, ref):  # type: ignore[no-untyped-def]
        self.gets += 1
        if self.failed_gets:
            self.failed_gets -= 1
            raise StoreUnavailable("injected: read failed")
        return super().get(ref)


def new_job(rev: str = "r0") -> NewJob:
    return NewJob(REF, "tasks.t", State.SCHEDULED, node="n", rev=rev)


def dispatch(rev: str = "r0") -> Transition:
    return Transition(State.DISPATCHED, frozenset({State.SCHEDULED}), node="n", reason="d", rev=rev)


@pytest.fixture
def store() -> LossyStore:
    return LossyStore()


def test_an_answered_transition_is_the_stores_answer(store: LossyStore) -> None:
    store.create(new_job())
    applied = settle.transition(store, REF, dispatch())
    assert (applied.decision, applied.status, applied.error) == (
        Decision.APPLIED,
        TransitionStatus.APPLIED,
        None,
    )
    assert applied.job is not None and applied.job.state is State.DISPATCHED
    refused = settle.transition(store, REF, dispatch())
    assert (refused.decision, refused.status) == (Decision.NOT_APPLIED, TransitionStatus.CONFLICT)
    assert refused.job == applied.job  # the record as it is


def test_a_lost_answer_is_read_back_applied(store: LossyStore) -> None:
    store.create(new_job())
    store.writes = ["lose"]
    request = dispatch()
    written = settle.transition(store, REF, request)
    assert written.applied and written.status is None
    assert isinstance(written.error, StoreUnavailable)
    assert written.job is not None and written.job.rev == request.new_rev


def test_a_lost_write_that_did_not_apply_is_read_back_not_applied(store: LossyStore) -> None:
    store.create(new_job())
    store.writes = ["refuse"]
    written = settle.transition(store, REF, dispatch())
    assert (written.decision, written.status) == (Decision.NOT_APPLIED, None)
    assert written.job is not None and written.job.state is State.SCHEDULED
    assert written.error is not None and not written.applied


def test_a_write_moved_on_since_is_superseded_not_applied(store: LossyStore) -> None:
    store.create(new_job())
    first = dispatch()
    store.transition(REF, first)
    later = Transition(
        State.RUNNING, frozenset({State.DISPATCHED}), node="n", reason="gate", new_run_id="run"
    )
    store.transition(REF, later)
    found = settle.read_back(store, REF, first.new_rev)
    assert found.decision is Decision.SUPERSEDED and found.job is not None
    assert settle.decide(found.job, later.new_rev) is Decision.APPLIED
    assert settle.decide(found.job, "another") is Decision.NOT_APPLIED
    assert settle.decide(None, first.new_rev) is Decision.NOT_APPLIED


def test_reads_are_tried_a_bounded_number_of_times(store: LossyStore) -> None:
    store.create(new_job())
    store.writes, store.failed_gets = ["lose"], settle.READ_BACK_TRIES - 1
    assert settle.transition(store, REF, dispatch()).applied  # the last try read it
    store.writes, store.failed_gets, store.gets = ["lose"], settle.READ_BACK_TRIES, 0
    written = settle.transition(store, REF, dispatch())
    assert (written.decision, written.job, store.gets) == (
        Decision.UNKNOWN,
        None,
        settle.READ_BACK_TRIES,
    )
    store.writes, store.failed_gets, store.gets = ["lose"], 1, 0
    assert settle.transition(store, REF, dispatch(), tries=1).decision is Decision.UNKNOWN
    assert store.gets == 1


def test_a_brief_transition_answers_the_status_and_a_refused_one_the_record(
    store: LossyStore,
) -> None:
    store.create(new_job())
    applied = settle.transition(store, REF, dispatch(), brief=True)
    assert applied.applied
    refused = settle.transition(store, REF, dispatch(), brief=True)
    assert refused.status is TransitionStatus.CONFLICT
    assert refused.job is not None and refused.job.state is State.DISPATCHED


def test_a_lost_create_is_read_back_as_the_create_repeated_answers(store: LossyStore) -> None:
    ours = new_job("ours")
    store.writes = ["lose"]
    written = settle.create(store, ours)
    assert (written.decision, written.status) == (Decision.APPLIED, CreateStatus.EXISTS)
    assert written.error is not None and written.job is not None
    # a create of another rev for the same job: the record exists, not ours
    store.writes = ["refuse"]
    other = settle.create(store, new_job("other"))
    assert (other.decision, other.status) == (Decision.NOT_APPLIED, CreateStatus.EXISTS)
    # and answered: the store's own answer, a repeat of ours applied
    assert settle.create(store, ours).decision is Decision.APPLIED
    assert settle.create(store, new_job("third")).decision is Decision.NOT_APPLIED


def test_a_lost_create_with_no_record_has_no_status(store: LossyStore) -> None:
    store.writes = ["refuse"]
    written = settle.create(store, new_job())
    assert (written.decision, written.status, written.job) == (Decision.NOT_APPLIED, None, None)
    store.writes, store.failed_gets = ["refuse"], 1
    unread = settle.create(store, new_job(), tries=1)
    assert (unread.decision, unread.status) == (Decision.UNKNOWN, None)


def test_a_lost_batch_is_read_back_write_by_write(store: LossyStore) -> None:
    news = [
        NewJob(JobRef.submitted(f"b{i}"), "tasks.t", State.SCHEDULED, node="n") for i in range(2)
    ]
    store.create(NewJob(news[0].ref, "tasks.t", State.SCHEDULED, node="n", rev="earlier"))
    store.writes = ["lose"]
    written = settle.create_many(store, news, brief=True)
    # the first existed before (another rev), the second was created by the lost batch
    assert [w.decision for w in written] == [Decision.NOT_APPLIED, Decision.APPLIED]
    assert all(w.error is not None for w in written)
