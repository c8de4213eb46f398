"""Payload signing on an InMemoryStore: the setting, the signer, and every path that publishes.

Issue 11, hole 18: ``exactonce_signing_key`` was accepted and did nothing.
These tests fail on the code before the fix (no signing module; a list of
keys refused; tampered records published). The same refusal on every real
backend is in ``tests/contract/test_signing.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from celery_exactonce import runtime
from celery_exactonce.config import ExactOnceConfig
from celery_exactonce.core import exceptions
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.dispatch.dispatcher import Dispatcher
from celery_exactonce.dispatch.messages import GATED_OPTION
from celery_exactonce.dispatch.outcomes import Outcome
from celery_exactonce.observe import metrics
from celery_exactonce.reconcile.reconciler import Reconciler
from celery_exactonce.stores.signing import Signer, SigningStore, signed_content
from celery_exactonce.testing import FrozenClock, InMemoryStore
from tests.support.reconciling import GATED, Broker, make_app

KEY = "signing-key-0123456789abcdef"
OLD = "older-signing-key-0123456789"
START = datetime(2026, 3, 1, 12, 0, 0, tzinfo=timezone.utc)


@pytest.fixture(autouse=True)
def _counters() -> Iterator[None]:
    metrics.COUNTERS.reset()
    yield
    metrics.COUNTERS.reset()


# -- the setting -----------------------------------------------------------------------


def test_the_setting_takes_one_key_or_a_list_and_hides_them() -> None:
    one = ExactOnceConfig(store_url="memory://", signing_key=KEY)
    assert one.signing_key == KEY
    many = ExactOnceConfig(store_url="memory://", signing_key=[KEY, OLD])  # type: ignore[arg-type]
    assert many.signing_key == (KEY, OLD)  # frozen
    for config in (one, many):
        assert KEY not in repr(config) and OLD not in repr(config)
        assert config.redacted()["signing_key"] == "***"


@pytest.mark.parametrize(
    ("value", "culprit"),
    [
        ("short", "exactonce_signing_key must be at least 16"),
        ([KEY, "short"], "exactonce_signing_key[1] must be at least 16"),
        ([], "exactonce_signing_key must be a string or a non-empty list"),
        (12345678901234567890, "exactonce_signing_key must be a string or a non-empty list"),
        ([KEY, b"bytes-key-0123456789"], "exactonce_signing_key[1] must be a string"),
    ],
)
def test_a_bad_signing_key_is_refused_naming_it_never_showing_it(value: Any, culprit: str) -> None:
    with pytest.raises(exceptions.ConfigurationError) as caught:
        ExactOnceConfig(store_url="memory://", signing_key=value)
    assert culprit in str(caught.value)
    assert caught.value.setting == "exactonce_signing_key"
    assert "short" not in str(caught.value).replace("at least", "")


# -- the signer ------------------------------------------------------------------------


def new_job(**changes: Any) -> NewJob:
    fields: dict[str, Any] = {
        "ref": JobRef.submitted("j1"),
        "task": "tasks.t",
        "state": State.SCHEDULED,
        "node": "n",
        "args": [1, "ü"],
        "kwargs": {"b": 2, "a": [1.5]},
        "options": {"queue": "q"},
        "deadline": START,
    }
    fields.update(changes)
    return NewJob(**fields)


def test_the_signature_covers_everything_a_publish_sends() -> None:
    """Changing the ref, task, args, kwargs, options, entry, slot or deadline breaks it."""
    signer = Signer(KEY)
    base = new_job()
    signature = signer.sign(base)
    assert signature.startswith("v1:") and len(signature) == 3 + 64
    for change in (
        {"ref": JobRef.submitted("j2")},
        {"task": "tasks.u"},
        {"args": [1, "u"]},
        {"kwargs": {"b": 2, "a": [1.25]}},
        {"options": {"queue": "r"}},
        {"deadline": START.replace(second=1)},
    ):
        assert signer.sign(new_job(**change)) != signature, change
    occurrence = new_job(ref=JobRef.occurrence("o1"), entry="e", fire_time=START)
    assert signer.sign(occurrence) != signer.sign(dataclasses.replace(occurrence, entry="f"))
    # Canonical: key order and tuple-vs-list do not matter.
    assert signer.sign(new_job(kwargs={"a": [1.5], "b": 2})) == signature
    assert signed_content(new_job(args=(1, "ü"))) == signed_content(base)


def test_rotation_signs_with_the_first_key_and_verifies_with_any() -> None:
    store = InMemoryStore("ns")
    old = SigningStore(store, Signer(OLD)).create(new_job(ref=JobRef.submitted("old"))).job
    new = SigningStore(store, Signer([KEY, OLD])).create(new_job(ref=JobRef.submitted("new"))).job
    assert old is not None and new is not None
    assert new.signature == Signer(KEY).sign(new)
    rotating = Signer([KEY, OLD])
    assert rotating.verify(old) and rotating.verify(new)
    assert not Signer(KEY).verify(old)
    assert "signed with a key no longer configured" in (Signer(KEY).problem(old) or "")
    assert "not signed" in (rotating.problem(dataclasses.replace(new, signature=None)) or "")


# -- every path that publishes ---------------------------------------------------------


class Signed:
    """An app with a signing key, its runtime on an InMemoryStore, and a fake broker."""

    def __init__(self) -> None:
        self.clock = FrozenClock(START)
        self.store = InMemoryStore("sig", clock=self.clock)
        self.app = make_app({"exactonce_signing_key": [KEY, OLD]})
        self.rt = runtime.install(self.app, self.store)
        self.broker = Broker()
        self.rt.dispatcher = Dispatcher(self.rt.store, self.broker, node="n", signer=self.rt.signer)

    def create(self, state: State = State.SCHEDULED, **changes: Any) -> Any:
        run_id = "r1" if state is State.RUNNING else None
        new = new_job(
            task=GATED,
            state=state,
            run_id=run_id,
            deadline=None,
            options={GATED_OPTION: True},
            **changes,
        )
        job = self.rt.store.create(new).job
        assert job is not None
        return job

    def tamper(self, ref: JobRef, **changes: Any) -> None:
        self.store._jobs[ref] = dataclasses.replace(self.store._jobs[ref], **changes)


@pytest.fixture
def signed() -> Iterator[Signed]:
    world = Signed()
    yield world
    runtime.reset(world.app)


def test_the_runtime_signs_every_record_it_writes(signed: Signed) -> None:
    """Fails before the fix: the key was read and never used."""
    assert isinstance(signed.rt.store, SigningStore)
    job = signed.create()
    assert job.signature == Signer(KEY).sign(job)
    assert signed.rt.dispatcher.dispatch(job).outcome is Outcome.PUBLISHED
    assert signed.broker.ids() == ["j1"]


def test_a_tampered_record_is_refused_failed_counted_and_logged(
    signed: Signed, caplog: pytest.LogCaptureFixture
) -> None:
    job = signed.create()
    signed.tamper(job.ref, args=["evil"])
    result = signed.rt.dispatcher.dispatch(signed.store._jobs[job.ref])
    assert result.outcome is Outcome.FAILED
    assert signed.broker.ids() == []
    stored = signed.store.get(job.ref)
    assert stored is not None and stored.state is State.FAILED
    assert stored.reason.startswith("signature invalid: the record does not match")
    assert stored.dispatches == 0  # refused before the DISPATCHED write
    assert metrics.COUNTERS.get("signature_invalid") == 1
    (record,) = [r for r in caplog.records if getattr(r, "action", "") == "signature_invalid"]
    assert record.levelname == "ERROR" and "not published" in record.getMessage()


def test_a_record_tampered_between_listing_and_publish_is_refused(signed: Signed) -> None:
    """The record about to be published is checked too, after the DISPATCHED write."""
    job = signed.create()
    store = signed.store
    real = store.transition_many

    def tamper_then_write(requests: Any, *, brief: bool = False) -> Any:
        results = real(requests, brief=False)
        ref = requests[0][0]
        store._jobs[ref] = dataclasses.replace(store._jobs[ref], options={"queue": "evil"})
        return [dataclasses.replace(r, job=store._jobs[ref]) for r in results]

    store.transition_many = tamper_then_write  # type: ignore[method-assign]
    result = signed.rt.dispatcher.dispatch(job)
    store.transition_many = real  # type: ignore[method-assign]
    assert result.outcome is Outcome.FAILED and signed.broker.ids() == []
    stored = store.get(job.ref)
    assert stored is not None and stored.state is State.FAILED  # from DISPATCHED
    assert metrics.COUNTERS.get("signature_invalid") == 1


def test_the_reconciler_never_replays_a_tampered_record(signed: Signed) -> None:
    """A stale SCHEDULED record is replayed through the dispatcher, which refuses it."""
    job = signed.create()
    signed.tamper(job.ref, kwargs={"evil": True})
    signed.clock.advance(signed.rt.config.replay_age + 1)
    report = Reconciler(signed.rt, tasks=signed.app.tasks).run_pass()
    assert report.ran and report.failed == 1 and report.replayed == 0
    assert signed.broker.ids() == []
    stored = signed.store.get(job.ref)
    assert stored is not None and stored.state is State.FAILED
    assert metrics.COUNTERS.get("signature_invalid") == 1


def test_an_unsigned_record_is_refused_when_a_key_is_configured(signed: Signed) -> None:
    """Written by a node without the key (or stripped): refused, not trusted."""
    unsigned = signed.store.create(
        new_job(ref=JobRef.submitted("u1"), task=GATED, deadline=None, options={GATED_OPTION: True})
    ).job
    assert unsigned is not None and unsigned.signature is None
    assert signed.rt.dispatcher.dispatch(unsigned).outcome is Outcome.FAILED
    stored = signed.store.get(unsigned.ref)
    assert stored is not None and "not signed" in stored.reason
    assert signed.broker.ids() == []


def test_a_retry_with_new_args_is_re_signed_and_published(signed: Signed) -> None:
    """The transition of a Celery retry carries a fresh signature over the new args."""
    running = signed.create(State.RUNNING)
    request = Transition(
        State.DISPATCHED,
        frozenset({State.RUNNING}),
        node="n",
        reason="retry",
        run_id="r1",
        next_attempt=True,
        args=[2, "new"],
    )
    result = signed.rt.store.transition(running.ref, request)
    assert result.applied and result.job is not None
    assert result.job.args == [2, "new"] and Signer(KEY).verify(result.job)
    assert signed.rt.dispatcher.publish(result.job).outcome is Outcome.PUBLISHED
    assert signed.broker.ids() == ["j1"]


class BriefStore(InMemoryStore):
    """Answers brief creates with a status only, as the Redis store does (the contract allows)."""

    def create_many(self, news: Any, *, epoch: Any = None, brief: bool = False) -> Any:
        results = super().create_many(news, epoch=epoch, brief=brief)
        return [dataclasses.replace(r, job=None) for r in results] if brief else results


def test_beat_claims_are_signed_when_the_store_answers_briefly() -> None:
    """Beat dispatches the record it builds from its own claim: that claim must be signed.

    Failed before the scheduler signed its claims: on Redis every slot was refused
    as unsigned (found by tests/acceptance/test_secrets.py).
    """
    from celery import Celery

    from celery_exactonce.beat.scheduler import ExactOnceScheduler
    from tests.support.beat_cluster import START as BEAT_START
    from tests.support.beat_cluster import Broker as BeatBroker
    from tests.support.beat_cluster import every, isolated, register_plain_tasks

    clock = FrozenClock(BEAT_START - timedelta(days=1))
    store = BriefStore("beat", clock=clock)
    store.epoch()
    clock.set(BEAT_START)
    app = Celery("signed-beat", set_as_current=False)
    app.conf.update(
        exactonce_store_url="memory://",
        exactonce_signing_key=KEY,
        timezone="UTC",
        beat_schedule={"tick": every(1)},
    )
    register_plain_tasks(app, app.conf.beat_schedule)
    rt = runtime.install(app, store)
    broker = BeatBroker()
    rt.dispatcher = Dispatcher(rt.store, broker, node="beat", signer=rt.signer)
    with isolated():
        scheduler = ExactOnceScheduler(app)
        for _ in range(3):
            clock.advance(1)
            scheduler.tick()
        assert metrics.COUNTERS.get("signature_invalid") == 0
    assert len(broker.sent) >= 3
    assert all(Signer(KEY).verify(job) for job in broker.sent)
    runtime.reset(app)


def test_kombu_typed_arguments_are_signed_as_stored_and_verify(signed: Signed) -> None:
    """datetime, Decimal, UUID and bytes are stored in kombu's encoding: signed in that form."""
    import decimal
    import uuid
    from datetime import datetime, timezone

    args = [
        datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc),
        decimal.Decimal("1.50"),
        uuid.UUID(int=7),
        b"\x00\xff",
    ]
    job = signed.create(args=args)
    assert job.signature == Signer(KEY).sign(job)
    assert signed.rt.dispatcher.dispatch(job).outcome is Outcome.PUBLISHED
    assert signed.broker.ids() == ["j1"]
