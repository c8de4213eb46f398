"""Compare-and-swap transitions, heartbeats and terminal states, on every store."""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import pytest

from celery_exactonce.core import exceptions
from celery_exactonce.core.jobs import (
    HISTORY_LIMIT,
    CreateStatus,
    TransitionStatus,
    apply_transition,
)
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import TERMINAL, State
from celery_exactonce.core.writes import Action, Lease, Transition
from celery_exactonce.stores.base import StateStore
from tests.support.backends import StoreFactory
from tests.support.helpers import NODE, occurrence, poll, task_job, to


def _dispatched(store: StateStore, job_id: str | None = None) -> tuple[JobRef, str]:
    new = task_job(job_id)
    store.create(new)
    result = store.transition(new.ref, to(State.DISPATCHED, State.SCHEDULED, rev=new.rev))
    assert result.applied and result.job is not None
    return new.ref, result.job.rev


def test_dispatch_cas_returns_the_payload(store: StateStore) -> None:
    new = task_job(args=(4, 5), kwargs={"a": 1})
    store.create(new)
    request = to(State.DISPATCHED, State.SCHEDULED, rev=new.rev)
    result = store.transition(new.ref, request)
    assert result.status is TransitionStatus.APPLIED and result.job is not None
    job = result.job
    assert (job.state, job.rev, job.dispatches) == (State.DISPATCHED, request.new_rev, 1)
    assert (job.args, job.kwargs) == ([4, 5], {"a": 1})
    assert job.history[-1].src is State.SCHEDULED and job.history[-1].rev == request.new_rev
    assert store.get(new.ref) == job


def test_wrong_state_or_rev_conflicts_and_changes_nothing(store: StateStore) -> None:
    ref, rev = _dispatched(store)
    before = store.get(ref)
    stale = store.transition(ref, to(State.DISPATCHED, State.SCHEDULED, rev=rev))
    wrong_rev = store.transition(ref, to(State.PUBLISHED, State.DISPATCHED, rev="old"))
    assert (
        stale.status is TransitionStatus.CONFLICT and wrong_rev.status is TransitionStatus.CONFLICT
    )
    assert stale.job == before and store.get(ref) == before


def test_missing_record_is_not_found(store: StateStore) -> None:
    result = store.transition(JobRef.submitted("ghost"), to(State.DISPATCHED, State.SCHEDULED))
    assert result.status is TransitionStatus.NOT_FOUND and result.job is None


def test_gate_cas_on_attempt_sets_run_id(store: StateStore) -> None:
    ref, _ = _dispatched(store)
    stale_attempt = to(State.RUNNING, State.DISPATCHED, State.SCHEDULED, attempt=1, new_run_id="r0")
    assert store.transition(ref, stale_attempt).status is TransitionStatus.CONFLICT
    gate = to(State.RUNNING, State.DISPATCHED, State.SCHEDULED, attempt=0, new_run_id="run-1")
    job = store.transition(ref, gate).job
    assert job is not None and (job.state, job.run_id) == (State.RUNNING, "run-1")
    assert job.heartbeat_at is not None
    # A second delivery of the same attempt loses
    again = to(State.RUNNING, State.DISPATCHED, State.SCHEDULED, attempt=0, new_run_id="run-2")
    assert store.transition(ref, again).status is TransitionStatus.CONFLICT


def test_worker_writes_cas_on_run_id(store: StateStore) -> None:
    ref, _ = _dispatched(store)
    store.transition(ref, to(State.RUNNING, State.DISPATCHED, attempt=0, new_run_id="mine"))
    zombie = to(State.SUCCEEDED, State.RUNNING, run_id="not-mine")
    assert store.transition(ref, zombie).status is TransitionStatus.CONFLICT
    done = store.transition(ref, to(State.SUCCEEDED, State.RUNNING, run_id="mine")).job
    assert done is not None and done.state is State.SUCCEEDED and done.terminal_at is not None


def test_retry_is_the_next_attempt_with_new_arguments(store: StateStore) -> None:
    ref, _ = _dispatched(store)
    store.transition(ref, to(State.RUNNING, State.DISPATCHED, attempt=0, new_run_id="r1"))
    retry = to(State.DISPATCHED, State.RUNNING, run_id="r1", next_attempt=True, args=[7], kwargs={})
    job = store.transition(ref, retry).job
    assert job is not None
    assert (job.state, job.attempt, job.run_id, job.args, job.kwargs) == (
        State.DISPATCHED,
        1,
        None,
        [7],
        {},
    )
    assert job.options == {"queue": "celery"}
    # The old attempt's message no longer passes the gate; the new one does
    old = to(State.RUNNING, State.DISPATCHED, attempt=0, new_run_id="late")
    assert store.transition(ref, old).status is TransitionStatus.CONFLICT
    assert store.transition(
        ref, to(State.RUNNING, State.DISPATCHED, attempt=1, new_run_id="r2")
    ).applied


def test_countdown_retry_goes_back_to_pending(store: StateStore) -> None:
    ref, _ = _dispatched(store)
    store.transition(ref, to(State.RUNNING, State.DISPATCHED, attempt=0, new_run_id="r1"))
    run_at = store.now() + timedelta(seconds=30)
    job = store.transition(
        ref, to(State.PENDING, State.RUNNING, run_id="r1", next_attempt=True, run_at=run_at)
    ).job
    assert job is not None and (job.state, job.attempt, job.run_at) == (State.PENDING, 1, run_at)


def test_the_next_attempt_keeps_no_run_at_of_the_last(store: StateStore) -> None:
    """A retry without a countdown after a delayed attempt: its messages carry no old ``eta``."""
    ref, _ = _dispatched(store)
    store.transition(ref, to(State.RUNNING, State.DISPATCHED, attempt=0, new_run_id="r1"))
    run_at = store.now() + timedelta(seconds=-1)  # due at once: the sweep claims it
    store.transition(
        ref, to(State.PENDING, State.RUNNING, run_id="r1", next_attempt=True, run_at=run_at)
    )
    (claimed,) = store.claim_due(limit=1, node=NODE)
    assert claimed.run_at == run_at  # the swept attempt still shows what it waited for
    store.transition(ref, to(State.DISPATCHED, State.SCHEDULED, rev=claimed.rev))
    store.transition(ref, to(State.RUNNING, State.DISPATCHED, attempt=1, new_run_id="r2"))
    job = store.transition(
        ref, to(State.DISPATCHED, State.RUNNING, run_id="r2", next_attempt=True)
    ).job
    assert job is not None and (job.attempt, job.run_at) == (2, None)
    assert store.get(ref).run_at is None  # type: ignore[union-attr]


@pytest.mark.parametrize("terminal", sorted(TERMINAL, key=str))
def test_terminal_refuses_every_transition(store: StateStore, terminal: State) -> None:
    # Given a job driven into a terminal state along a legal path
    ref, rev = _dispatched(store)
    if terminal in (State.SUCCEEDED, State.FAILED):
        store.transition(ref, to(State.RUNNING, State.DISPATCHED, attempt=0, new_run_id="r"))
        final = store.transition(ref, to(terminal, State.RUNNING, run_id="r"))
    else:
        final = store.transition(ref, to(terminal, State.DISPATCHED, rev=rev))
    assert final.applied and final.job is not None and final.job.terminal
    # Then no transition, whatever its guards, moves it
    for src in (State.PENDING, State.SCHEDULED, State.DISPATCHED, State.RUNNING):
        for dst in sorted(set(State) - {src}, key=str):
            try:
                request = to(
                    dst,
                    src,
                    new_run_id="x" if dst is State.RUNNING else None,
                    run_at=store.now() if dst is State.PENDING else None,
                    next_attempt=(src, dst)
                    in {(State.RUNNING, State.DISPATCHED), (State.RUNNING, State.PENDING)},
                )
            except exceptions.InvalidRequest:
                continue  # not an edge of the table at all
            assert store.transition(ref, request).status is TransitionStatus.CONFLICT
    assert store.get(ref) == final.job


def test_transitions_out_of_terminal_states_cannot_be_requested() -> None:
    for terminal in TERMINAL:
        with pytest.raises(exceptions.InvalidRequest, match="not allowed"):
            to(State.RUNNING, terminal, new_run_id="r")
    with pytest.raises(exceptions.InvalidRequest, match="next_attempt"):
        to(State.DISPATCHED, State.RUNNING)


def _race(store: StateStore, ref: JobRef, requests: list[Transition]) -> list[TransitionStatus]:
    """Each request from a thread of its own, released together; their statuses, sorted."""
    barrier = threading.Barrier(len(requests))
    results: list[TransitionStatus] = []
    lock = threading.Lock()

    def attempt(request: Transition) -> None:
        barrier.wait(timeout=10)
        status = store.transition(ref, request).status
        with lock:
            results.append(status)

    threads = [threading.Thread(target=attempt, args=(request,)) for request in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return sorted(results)


ONE_WINNER = sorted([TransitionStatus.APPLIED] + [TransitionStatus.CONFLICT] * 7)


def test_eight_concurrent_attempts_one_winner(store: StateStore) -> None:
    ref, _ = _dispatched(store)
    requests = [
        to(State.RUNNING, State.DISPATCHED, attempt=0, new_run_id=f"run-{i}") for i in range(8)
    ]
    assert _race(store, ref, requests) == ONE_WINNER
    job = store.get(ref)
    assert job is not None and job.state is State.RUNNING and len(job.history) == 3


def test_a_cas_guarded_by_another_task_name_conflicts(store: StateStore) -> None:
    """The gate names its task: a message for one task never runs another's job (SCENARIOS 45e)."""
    ref, _ = _dispatched(store)
    before = store.get(ref)
    assert before is not None
    other = to(State.RUNNING, State.DISPATCHED, attempt=0, task="tasks.other", new_run_id="r")
    assert store.transition(ref, other).status is TransitionStatus.CONFLICT
    assert store.get(ref) == before
    mine = to(State.RUNNING, State.DISPATCHED, attempt=0, task=before.task, new_run_id="r")
    assert store.transition(ref, mine).applied


def test_a_run_is_taken_over_once_from_its_run_id(store: StateStore) -> None:
    """The gate's take-over, RUNNING(r1) → RUNNING(own run id): eight racers, one winner."""
    ref, _ = _dispatched(store)
    assert store.transition(ref, to(State.RUNNING, State.DISPATCHED, new_run_id="r1")).applied
    requests = [
        to(State.RUNNING, State.RUNNING, run_id="r1", attempt=0, new_run_id=f"r-{i}")
        for i in range(8)
    ]
    assert _race(store, ref, requests) == ONE_WINNER
    job = store.get(ref)
    assert job is not None and job.state is State.RUNNING and job.run_id != "r1"
    assert store.heartbeat(ref, "r1") is False and store.heartbeat(ref, job.run_id or "")


def test_stale_rev_loses_after_expiry_and_recreation(store_factory: StoreFactory) -> None:
    store = store_factory(retention=0.05)
    ref, rev = _dispatched(store, "recycled")
    store.transition(ref, to(State.PUBLISHED, State.DISPATCHED, rev=rev))
    poll(lambda: store.purge_expired(10) or store.get(ref) is None)
    # The id is created again; an old writer's rev must not match the new record
    store.create(task_job("recycled"))
    store.transition(ref, to(State.DISPATCHED, State.SCHEDULED))
    late = store.transition(ref, to(State.PUBLISHED, State.DISPATCHED, rev=rev))
    assert late.status is TransitionStatus.CONFLICT


def test_history_is_capped(store: StateStore) -> None:
    ref, rev = _dispatched(store)
    for _ in range(HISTORY_LIMIT + 5):
        result = store.transition(ref, to(State.DISPATCHED, State.DISPATCHED, rev=rev))
        assert result.job is not None
        rev = result.job.rev
    job = store.get(ref)
    assert job is not None and len(job.history) == HISTORY_LIMIT
    assert job.history[-1].rev == rev and job.dispatches == HISTORY_LIMIT + 6


def test_the_reconcilers_action_is_recorded_in_the_history_entry(store: StateStore) -> None:
    ref, rev = _dispatched(store)
    redispatch = to(State.DISPATCHED, State.DISPATCHED, rev=rev, action=Action.REDISPATCH)
    result = store.transition(ref, redispatch)
    assert result.applied
    again = store.transition(ref, to(State.DISPATCHED, State.DISPATCHED, rev=redispatch.new_rev))
    assert again.applied
    job = store.get(ref)
    assert job is not None
    assert [entry.action for entry in job.history] == [None, None, Action.REDISPATCH, None]
    rerun = to(State.DISPATCHED, State.DISPATCHED, rev=job.rev, action=Action.RERUN)
    (batched,) = store.transition_many([(ref, rerun)])
    assert batched.job is not None and batched.job.history[-1].action is Action.RERUN


def test_op_id_reads_back_after_an_unknown_outcome(store: StateStore) -> None:
    # A writer whose write timed out settles it by reading the record back
    ref, rev = _dispatched(store)
    request = to(State.PUBLISHED, State.DISPATCHED, rev=rev)
    store.transition(ref, request)
    job = store.get(ref)
    assert job is not None and job.applied(request.new_rev)
    assert not job.applied(uuid.uuid4().hex)


def test_a_reason_with_unencodable_text_is_stored_sanitised(store: StateStore) -> None:
    """A completion reason holding a lone surrogate and a NUL still applies.

    Fails before the fix: ``UnicodeEncodeError`` (PostgreSQL, SQLite) or
    ``InvalidPayload`` (Redis) from the write, so the job stayed ``RUNNING``.
    """
    name = b"report-\xff.csv".decode("utf-8", "surrogateescape")  # a non-UTF-8 file name
    reason = f"FileNotFoundError: [Errno 2] No such file: {name!s}\x00\nsee log"
    new = task_job(state=State.RUNNING)
    store.create(new)
    request = Transition(
        State.FAILED, frozenset({State.RUNNING}), node=NODE, reason=reason, run_id=new.run_id
    )
    result = store.transition(new.ref, request)
    assert result.applied
    job = store.get(new.ref)
    assert job is not None and job.state is State.FAILED
    assert (
        job.reason == "FileNotFoundError: [Errno 2] No such file: report-\ufffd.csv\ufffd\nsee log"
    )
    assert job.history[-1].reason == job.reason


def test_heartbeat_touches_without_changing_rev(store: StateStore) -> None:
    ref, _ = _dispatched(store)
    job = store.transition(ref, to(State.RUNNING, State.DISPATCHED, attempt=0, new_run_id="r")).job
    assert job is not None
    poll(lambda: store.now() > job.touched_at)
    assert store.heartbeat(ref, "r")
    beat = store.get(ref)
    assert beat is not None and beat.rev == job.rev and beat.touched_at > job.touched_at
    assert beat.heartbeat_at is not None and beat.heartbeat_at > job.touched_at
    assert beat.history == job.history
    assert not store.heartbeat(ref, "other-run")
    assert not store.heartbeat(JobRef.submitted("ghost"), "r")


def test_timeout_cas_requires_staleness_by_store_time(store: StateStore) -> None:
    ref, _ = _dispatched(store)
    store.transition(ref, to(State.RUNNING, State.DISPATCHED, attempt=0, new_run_id="r"))
    fresh = to(State.TIMEOUT, State.RUNNING, stale_for=3600)
    assert store.transition(ref, fresh).status is TransitionStatus.CONFLICT
    job = store.get(ref)
    assert job is not None
    poll(lambda: store.now() - job.touched_at >= timedelta(seconds=0.05))
    assert store.transition(ref, to(State.TIMEOUT, State.RUNNING, stale_for=0.05)).applied


def test_lease_guards_reconciler_transitions(store: StateStore) -> None:
    ref, rev = _dispatched(store)
    lease = Lease("reconcile", "token-1")
    request = to(State.TIMEOUT, State.DISPATCHED, rev=rev, lease=lease)
    # Without the lease the transition is refused
    lost = store.transition(ref, request)
    assert lost.status is TransitionStatus.LEASE_LOST
    assert store.acquire_lease("reconcile", "token-2", 30)
    assert store.transition(ref, request).status is TransitionStatus.LEASE_LOST
    assert store.release_lease("reconcile", "token-2")
    # With it, it applies
    assert store.acquire_lease("reconcile", "token-1", 30)
    assert store.transition(ref, request).applied


def test_transition_to_running_requires_a_run_id() -> None:
    with pytest.raises(exceptions.InvalidRequest, match="new_run_id"):
        Transition(State.RUNNING, frozenset({State.DISPATCHED}), node=NODE, reason="x")


def test_transition_many_is_transition_in_turn(store: StateStore) -> None:
    a, b = store.create(task_job()).job, store.create(task_job()).job
    assert a is not None and b is not None
    missing = JobRef.submitted("tm-missing")
    first = to(State.DISPATCHED, State.SCHEDULED, rev=a.rev)
    results = store.transition_many(
        [
            (a.ref, first),
            (b.ref, to(State.DISPATCHED, State.SCHEDULED, rev="not-the-rev")),
            (missing, to(State.DISPATCHED, State.SCHEDULED)),
            (a.ref, to(State.PUBLISHED, State.DISPATCHED, rev=first.new_rev)),
        ]
    )
    assert [r.status for r in results] == [
        TransitionStatus.APPLIED,
        TransitionStatus.CONFLICT,
        TransitionStatus.NOT_FOUND,
        TransitionStatus.APPLIED,
    ]
    assert results[0].job is not None and results[0].job.state is State.DISPATCHED
    after = store.get(a.ref)
    assert after is not None and after.state is State.PUBLISHED
    unchanged = store.get(b.ref)
    assert unchanged is not None and unchanged.state is State.SCHEDULED
    assert store.transition_many([]) == []


def test_large_batches_keep_their_order(store: StateStore) -> None:
    # Given a batch larger than any store's internal chunk (the Redis store's: 64 jobs),
    # where every third job already exists
    news = [task_job() for _ in range(150)]
    assert store.create_many(news[::3], brief=True)[-1].created
    created = store.create_many(news)
    assert [r.status for r in created] == [
        CreateStatus.EXISTS if i % 3 == 0 else CreateStatus.CREATED for i in range(150)
    ]
    assert [r.job.ref for r in created if r.job] == [new.ref for new in news]
    # When a CAS batch as large wins on every other job and loses on the rest
    requests = [
        (new.ref, to(State.DISPATCHED, State.SCHEDULED, rev=new.rev if i % 2 else "stale"))
        for i, new in enumerate(news)
    ]
    results = store.transition_many(requests)
    # Then each answer is its own job's, in order
    assert [r.status for r in results] == [
        TransitionStatus.APPLIED if i % 2 else TransitionStatus.CONFLICT for i in range(150)
    ]
    assert [r.job.ref for r in results if r.job] == [new.ref for new in news]
    assert [store.get(new.ref).state for new in news] == [  # type: ignore[union-attr]
        State.DISPATCHED if i % 2 else State.SCHEDULED for i in range(150)
    ]


def test_brief_batches_answer_statuses_and_write_the_same(store: StateStore) -> None:
    # Given a brief batched create: the statuses, and the records as a full create writes them
    news = [task_job(), task_job()]
    created = store.create_many(news, brief=True)
    assert [r.status for r in created] == [CreateStatus.CREATED] * 2
    assert store.create_many(news[:1], brief=True)[0].status is CreateStatus.EXISTS
    first = store.get(news[0].ref)
    assert first is not None and first.rev == news[0].rev and first.state is State.SCHEDULED
    # When a brief batched CAS applies one write and loses another
    win = to(State.DISPATCHED, State.SCHEDULED, rev=news[0].rev)
    lose = to(State.DISPATCHED, State.SCHEDULED, rev="not-the-rev")
    results = store.transition_many([(news[0].ref, win), (news[1].ref, lose)], brief=True)
    # Then the statuses say so, and the applied record is what apply_transition computes
    assert [r.status for r in results] == [TransitionStatus.APPLIED, TransitionStatus.CONFLICT]
    after = store.get(news[0].ref)
    assert after is not None
    local = apply_transition(first, win, after.touched_at)
    assert (after.state, after.rev, after.dispatches, after.payload) == (
        local.state,
        local.rev,
        local.dispatches,
        local.payload,
    )


def test_a_brief_cas_that_is_refused_answers_the_record_as_it_is(store: StateStore) -> None:
    """The worker gate's and the completion's CAS are brief: a refusal is decided on the record."""
    ref, rev = _dispatched(store)
    before = store.get(ref)
    # When brief CASes are refused, on a guard and on a lease
    conflict, lease_lost = store.transition_many(
        [
            (ref, to(State.RUNNING, State.SCHEDULED, attempt=0, new_run_id="r")),
            (ref, to(State.TIMEOUT, State.DISPATCHED, rev=rev, lease=Lease("reconcile", "t"))),
        ],
        brief=True,
    )
    # Then each answer carries the record, unchanged
    assert (conflict.status, lease_lost.status) == (
        TransitionStatus.CONFLICT,
        TransitionStatus.LEASE_LOST,
    )
    assert conflict.job == before and lease_lost.job == before and store.get(ref) == before
    # and one that applies may answer with the status only; the record is as a full CAS writes it
    gate = to(State.RUNNING, State.DISPATCHED, attempt=0, new_run_id="r")
    (applied,) = store.transition_many([(ref, gate)], brief=True)
    after = store.get(ref)
    assert applied.applied and applied.job in (None, after)
    assert after is not None and (after.state, after.rev, after.run_id) == (
        State.RUNNING,
        gate.new_rev,
        "r",
    )
    # and one that finds no record answers NOT_FOUND, with none
    (missing,) = store.transition_many(
        [(JobRef.submitted("ghost"), to(State.DISPATCHED, State.SCHEDULED))], brief=True
    )
    assert (missing.status, missing.job) == (TransitionStatus.NOT_FOUND, None)


def test_a_note_is_appended_to_the_history_and_nothing_else_moves(store: StateStore) -> None:
    """``annotate``: a claim conflict or a late outcome said in the record (SCENARIOS 57)."""
    ref, _ = _dispatched(store)
    before = store.get(ref)
    assert before is not None
    assert store.annotate(ref, node=NODE, reason="claim conflict: \udcff other app", op_id="n1")
    after = store.get(ref)
    assert after is not None
    note = after.history[-1]
    assert (note.src, note.dst, note.node, note.rev) == (before.state, before.state, NODE, "n1")
    assert note.reason == "claim conflict: \ufffd other app" and after.applied("n1")
    assert after.history[:-1] == before.history
    assert (after.state, after.rev, after.touched_at) == (
        before.state,
        before.rev,
        before.touched_at,
    )
    # A repeat of the same note appends nothing; a missing record says so
    assert store.annotate(ref, node=NODE, reason="again", op_id="n1")
    assert store.get(ref) == after
    assert not store.annotate(JobRef.submitted("ghost"), node=NODE, reason="x", op_id="n2")
    # The record still moves on as before
    assert store.transition(ref, to(State.PUBLISHED, State.DISPATCHED, rev=before.rev)).applied


def test_notes_are_capped_with_the_history(store: StateStore) -> None:
    ref, _ = _dispatched(store)
    for i in range(HISTORY_LIMIT + 3):
        assert store.annotate(ref, node=NODE, reason=f"note {i}", op_id=f"n{i}")
    job = store.get(ref)
    assert job is not None and len(job.history) == HISTORY_LIMIT
    assert job.history[-1].reason == f"note {HISTORY_LIMIT + 2}"


def test_every_effect_is_apply_transitions(store: StateStore) -> None:
    """A job's whole life, each written record what ``apply_transition`` makes of the last.

    Stores that write the effects themselves (the SQL store's one-statement
    ``UPDATE``, the Redis scripts) are held to the shared rule, field by field,
    at the store time the write took (``touched_at``), the answer included.
    """
    fire = store.now() + timedelta(days=1)  # an occurrence's expiry counts from its slot
    new = occurrence("effects", fire)
    assert store.create(new).created
    assert store.acquire_lease("effects", "tok", 60)
    run_at = store.now() + timedelta(hours=1)
    steps = [
        to(State.DISPATCHED, State.SCHEDULED, rev=new.rev, task="tasks.tick"),
        to(State.RUNNING, State.DISPATCHED, attempt=0, new_run_id="run-1"),
        to(State.RUNNING, State.RUNNING, run_id="run-1", new_run_id="run-2"),
        to(State.PENDING, State.RUNNING, next_attempt=True, run_at=run_at, run_id="run-2"),
        to(State.SCHEDULED, State.PENDING, stale_for=0),
        to(State.DISPATCHED, State.SCHEDULED, State.DISPATCHED, lease=Lease("effects", "tok")),
        to(State.RUNNING, State.DISPATCHED, attempt=1, new_run_id="run-3"),
        to(State.DISPATCHED, State.RUNNING, next_attempt=True, run_id="run-3"),
        to(State.RUNNING, State.DISPATCHED, attempt=2, new_run_id="run-4"),
        to(State.SUCCEEDED, State.RUNNING, run_id="run-4"),
    ]
    for request in steps:
        before = store.get(new.ref)
        assert before is not None
        result = store.transition(new.ref, request)
        after = store.get(new.ref)
        assert result.applied and after is not None, request
        assert result.job == after
        assert after == apply_transition(before, request, after.touched_at), request
    # and a terminal record refuses, whatever its guards
    assert not store.transition(new.ref, to(State.CANCELLED, State.RUNNING)).applied


def test_a_brief_transition_writes_what_a_full_one_does(store: StateStore) -> None:
    ref, rev = _dispatched(store)
    before = store.get(ref)
    request = to(State.RUNNING, State.DISPATCHED, rev=rev, attempt=0, new_run_id="r")
    [result] = store.transition_many([(ref, request)], brief=True)
    after = store.get(ref)
    assert result.applied and after is not None and before is not None
    assert after == apply_transition(before, request, after.touched_at)
