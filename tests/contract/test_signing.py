"""Signed payloads on every store: a record tampered with in the backend is never published.

Issue 11, hole 18: ``exactonce_signing_key`` was accepted and did nothing, so
anyone who could write the store could make workers run any task. Each test
tampers with a record directly in the backend (a dict entry in memory,
``HSET``/``HDEL`` in Redis, an ``UPDATE`` in SQL) and checks the dispatch
refuses it: ``FAILED`` with a reason naming the signature, counted as
``signature_invalid``, nothing published. They fail on the code before the
fix (there was no signature to check).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import Transition
from celery_exactonce.dispatch.dispatcher import Dispatcher
from celery_exactonce.dispatch.outcomes import Outcome
from celery_exactonce.observe import metrics
from celery_exactonce.stores.base import StateStore
from celery_exactonce.stores.signing import Signer, SigningStore
from tests.support.helpers import NODE, tamper, task_job

OLD_KEY = "old-signing-key-0123456789abcdef"
NEW_KEY = "new-signing-key-fedcba9876543210"


class Broker:
    """Records what would have reached the broker."""

    def __init__(self) -> None:
        self.sent: list[Job] = []

    def __call__(self, job: Job, headers: Mapping[str, Any], extra: Mapping[str, Any]) -> None:
        self.sent.append(job)


@pytest.fixture(autouse=True)
def _counters() -> None:
    metrics.COUNTERS.reset()


def assert_refused(store: StateStore, ref: JobRef, broker: Broker, outcome: Outcome) -> None:
    assert outcome is Outcome.FAILED
    assert broker.sent == []
    job = store.get(ref)
    assert job is not None and job.state is State.FAILED
    assert job.reason.startswith("signature invalid")
    assert metrics.COUNTERS.get("signature_invalid") == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("args", ["rm", "-rf", "/"]),
        ("kwargs", {"x": "evil"}),
        ("options", {"queue": "elsewhere"}),
        ("task", "tasks.evil"),
        ("signature", None),  # stripped: an unsigned record while a key is configured
        ("signature", "v1:" + "0" * 64),  # forged
    ],
)
def test_a_record_tampered_with_in_the_store_is_refused_counted_and_never_published(
    store: StateStore, field: str, value: Any
) -> None:
    """Fails before the fix: the tampered payload was published as stored."""
    signer = Signer(NEW_KEY)
    signed, broker = SigningStore(store, signer), Broker()
    created = signed.create(task_job()).job
    assert created is not None and signer.verify(created)
    tamper(store, created.ref, field, value)
    listed = store.get(created.ref)
    assert listed is not None and not signer.verify(listed)
    result = Dispatcher(signed, broker, node=NODE, signer=signer).dispatch(listed)
    assert_refused(store, created.ref, broker, result.outcome)


def test_a_signed_record_reads_back_verified_and_is_published(store: StateStore) -> None:
    """The signature survives the store's encoding (non-ASCII kwargs included)."""
    signer = Signer(NEW_KEY)
    signed, broker = SigningStore(store, signer), Broker()
    created = signed.create(task_job(kwargs={"x": "ü", "n": [1.5, None]})).job
    assert created is not None
    listed = store.get(created.ref)
    assert listed is not None and listed.signature == created.signature
    assert signer.verify(listed)
    result = Dispatcher(signed, broker, node=NODE, signer=signer).dispatch(listed)
    assert result.outcome is Outcome.PUBLISHED
    assert [job.ref for job in broker.sent] == [created.ref]


def test_a_retry_that_changes_args_carries_a_fresh_signature(store: StateStore) -> None:
    """A Celery retry with new args is re-signed; one written unsigned loses the old signature."""
    signer = Signer(NEW_KEY)
    signed = SigningStore(store, signer)
    running = signed.create(task_job(state=State.RUNNING)).job
    assert running is not None and running.run_id is not None
    retry = Transition(
        State.DISPATCHED,
        frozenset({State.RUNNING}),
        node=NODE,
        reason="retry",
        run_id=running.run_id,
        next_attempt=True,
        args=[7],
        kwargs={"y": 8},
    )
    result = signed.transition(running.ref, retry)
    assert result.applied
    after = store.get(running.ref)
    assert after is not None and (after.args, after.kwargs) == ([7], {"y": 8})
    assert after.signature != running.signature and signer.verify(after)
    # The same change by a writer without the key leaves no stale signature behind.
    back = store.transition(
        running.ref,
        Transition(
            State.RUNNING, frozenset({State.DISPATCHED}), node=NODE, reason="gate", new_run_id="r2"
        ),
    )
    assert back.applied
    unsigned = store.transition(
        running.ref,
        Transition(
            State.DISPATCHED,
            frozenset({State.RUNNING}),
            node=NODE,
            reason="retry",
            run_id="r2",
            next_attempt=True,
            args=[9],
        ),
    )
    assert unsigned.applied
    last = store.get(running.ref)
    assert last is not None and last.signature is None and not signer.verify(last)


def test_a_tampered_record_is_never_re_signed_by_a_retry(store: StateStore) -> None:
    """A retry of a record whose options were changed must not launder them with a signature."""
    signer = Signer(NEW_KEY)
    signed = SigningStore(store, signer)
    running = signed.create(task_job(state=State.RUNNING)).job
    assert running is not None and running.run_id is not None
    tamper(store, running.ref, "options", {"queue": "elsewhere"})
    retry = Transition(
        State.DISPATCHED,
        frozenset({State.RUNNING}),
        node=NODE,
        reason="retry",
        run_id=running.run_id,
        next_attempt=True,
        args=[7],
    )
    assert signed.transition(running.ref, retry).applied
    after = store.get(running.ref)
    assert after is not None and not signer.verify(after)
    broker = Broker()
    outcome = Dispatcher(signed, broker, node=NODE, signer=signer).publish(after).outcome
    assert_refused(store, running.ref, broker, outcome)


def test_rotation_old_records_verify_new_ones_use_the_new_key_retired_keys_refuse(
    store: StateStore,
) -> None:
    """Keys [new, old]: old records still dispatch, new ones are signed with new; [new] alone
    refuses what only old signed."""
    old_signer, rotating = Signer(OLD_KEY), Signer([NEW_KEY, OLD_KEY])
    old_job = SigningStore(store, old_signer).create(task_job()).job
    assert old_job is not None
    new_job = SigningStore(store, rotating).create(task_job()).job
    assert new_job is not None
    assert new_job.signature == Signer(NEW_KEY).sign(new_job) != old_signer.sign(new_job)

    broker = Broker()
    dispatcher = Dispatcher(SigningStore(store, rotating), broker, node=NODE, signer=rotating)
    listed = store.get(old_job.ref)
    assert listed is not None
    assert dispatcher.dispatch(listed).outcome is Outcome.PUBLISHED

    retired = Signer(NEW_KEY)
    third = SigningStore(store, old_signer).create(task_job()).job
    assert third is not None
    broker = Broker()
    outcome = Dispatcher(store, broker, node=NODE, signer=retired).dispatch(third).outcome
    assert_refused(store, third.ref, broker, outcome)
