"""What ``ExactOnceTask`` decides before and around the gate (celery_exactonce/task/base.py).

Not the gate itself (test_gate.py) nor Celery's semantics kept (test_task_semantics.py):

* the reconciler policy a gated task's jobs store (``task_policy``);
* the start-up refusals of :func:`~celery_exactonce.task.gate.validate_gated_task`,
  and the gate refusing to run a task it refuses;
* when a job is due and when it expires: ``eta``, ``countdown`` and
  ``expires`` (``task.call_options.eta_of``, ``deadline_of``), directly and through ``apply_async``;
* which ``apply_async`` options are stored with a job (``task.call_options.storable_options``);
* revoke and ``expires`` seen by a worker (the ``task_revoked`` receiver).

Jobs live in an InMemoryStore; what is published is read from ``before_task_publish``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery, signals
from kombu import Exchange, Queue

from celery_exactonce import ConfigurationError, StoreUnavailable, runtime
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef, Space
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.dispatch.messages import GATED_OPTION, POLICY_OPTION, message_headers
from celery_exactonce.dispatch.outcomes import Outcome
from celery_exactonce.policy import task_policy
from celery_exactonce.task.base import ExactOnceTask
from celery_exactonce.task.call_options import deadline_of, eta_of, storable_options
from celery_exactonce.task.gate import validate_gated_task
from celery_exactonce.testing import InMemoryStore
from tests.support.helpers import move
from tests.support.publishing import publishing

NAMESPACE = "task-unit"
UTC = timezone.utc


class FaultyStore(InMemoryStore):
    """An in-memory store that can be down, and can run a hook before each transition."""

    def __init__(self, namespace: str) -> None:
        super().__init__(namespace)
        self.down = False
        self.before_transition: Any = None

    def get(self, ref):  # type: ignore[no-untyped-def]
        if self.down:
            raise StoreUnavailable("injected: store down")
        return super().get(ref)

    def transition(self, ref, request):  # type: ignore[no-untyped-def]
        if self.down:
            raise StoreUnavailable("injected: store down")
        if self.before_transition is not None:
            hook, self.before_transition = self.before_transition, None
            hook()
        return super().transition(ref, request)


@dataclass
class World:
    app: Celery
    store: FaultyStore
    #: Every message published: (task id, headers).
    sent: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)

    def task(self, name: str) -> ExactOnceTask:
        task = self.app.tasks[name]
        assert isinstance(task, ExactOnceTask)
        return task

    def job(self, job_id: str) -> Job:
        job = self.store.get(JobRef.submitted(job_id))
        assert job is not None, f"no job {job_id}"
        return job

    def put(self, state: State, task: str = "t.add", ref: JobRef | None = None) -> Job:
        """A job of ``task`` brought to ``state`` as the dispatch path and the gate would."""
        ref = ref or JobRef.submitted(uuid.uuid4().hex)
        occurrence = {"entry": "every-minute", "fire_time": datetime(2026, 3, 1, tzinfo=UTC)}
        created = self.store.create(
            NewJob(
                ref,
                task,
                State.SCHEDULED,
                node="n",
                args=[1, 2],
                options={GATED_OPTION: task != "t.plain"},
                **(occurrence if ref.space is Space.OCCURRENCE else {}),
            )
        )
        assert created.job is not None
        job = created.job
        path = {
            State.DISPATCHED: [State.DISPATCHED],
            State.RUNNING: [State.DISPATCHED, State.RUNNING],
            State.SUCCEEDED: [State.DISPATCHED, State.RUNNING, State.SUCCEEDED],
        }[state]
        for to in path:
            job = move(self.store, job, to)
        return job


@pytest.fixture
def world() -> Iterator[World]:
    app = Celery("task-unit", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.update(exactonce_store_url="memory://", exactonce_namespace=NAMESPACE)
    store = FaultyStore(NAMESPACE)
    runtime.install(app, store)
    world = World(app, store)

    def body(self: Any, *args: Any) -> None:
        world.runs.append(self.name)

    tasks: dict[str, dict[str, Any]] = {
        "t.add": {},
        "t.other": {},
        "t.tuned": {
            "exactonce_dispatch_timeout": 120,
            "exactonce_running_timeout": 900,
            "exactonce_redispatch": True,
            "exactonce_rerun": False,
        },
        "t.careless": {"reject_on_worker_lost": True},
    }
    for name, attrs in tasks.items():
        app.task(base=ExactOnceTask, shared=False, bind=True, name=name, **attrs)(body)
    app.task(shared=False, bind=True, name="t.plain")(body)

    def capture(sender: Any = None, headers: Any = None, **_kw: Any) -> None:
        world.sent.append((headers["id"], dict(headers)))

    with publishing(app, capture):
        yield world


def near(instant: datetime | None, expected: datetime, *, within: float = 5.0) -> bool:
    """``instant`` is ``expected`` give or take ``within`` seconds (both aware)."""
    assert instant is not None and instant.tzinfo is not None
    return abs((instant - expected).total_seconds()) <= within


# -- the policy a gated task's jobs store ----------------------------------------------------


def test_a_task_that_overrides_nothing_stores_an_empty_policy(world: World) -> None:
    assert task_policy(world.task("t.add")) == {}


def test_the_policy_holds_timeouts_as_seconds_and_only_the_opt_ins_set(world: World) -> None:
    policy = task_policy(world.task("t.tuned"))
    assert policy == {"dispatch_timeout": 120.0, "running_timeout": 900.0, "redispatch": True}
    assert all(type(policy[name]) is float for name in ("dispatch_timeout", "running_timeout"))


@pytest.mark.parametrize("countdown", [None, 60], ids=["now", "delayed"])
def test_every_submitted_job_stores_its_tasks_policy_and_the_gated_mark(
    world: World, countdown: int | None
) -> None:
    result = world.task("t.tuned").apply_async((1,), countdown=countdown)
    job = world.job(result.id)
    assert job.options[GATED_OPTION] is True
    assert job.options[POLICY_OPTION] == task_policy(world.task("t.tuned"))
    assert job.state is (State.PENDING if countdown else State.DISPATCHED)


def declared_body() -> None:
    """The body of the tasks a test declares (a named function: Celery reads its signature)."""


# -- start-up refusals -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attrs", "setting", "says"),
    [
        ({"reject_on_worker_lost": True}, "reject_on_worker_lost", "reject_on_worker_lost"),
        ({"exactonce_dispatch_timeout": 60}, "exactonce_dispatch_timeout", "> replay_age"),
        ({"exactonce_dispatch_deadline": 200}, "exactonce_dispatch_deadline", ">= dispatch_t"),
        ({"exactonce_running_timeout": 94}, "exactonce_running_timeout", "3 x heartbeat"),
        ({"exactonce_running_timeout": "soon"}, "exactonce_running_timeout", "number"),
        ({"exactonce_dispatch_timeout": True}, "exactonce_dispatch_timeout", "number"),
        ({"exactonce_running_timeout": -5}, "exactonce_running_timeout", "> 0"),
    ],
    ids=["reject_on_worker_lost", "dispatch_timeout", "deadline", "running", "str", "bool", "neg"],
)
def test_a_gated_task_that_could_run_twice_is_refused_naming_it_and_the_setting(
    world: World, attrs: dict[str, Any], setting: str, says: str
) -> None:
    # Settings: replay_age 60 s, dispatch_timeout 300 s, heartbeat_interval 30 s, max_skew 5 s
    world.app.task(base=ExactOnceTask, shared=False, name="t.bad", **attrs)(declared_body)
    with pytest.raises(ConfigurationError) as info:
        validate_gated_task(world.app.tasks["t.bad"])
    assert info.value.setting == setting
    assert str(info.value).startswith("t.bad: ") and says in str(info.value)
    if setting.startswith("exactonce_"):
        assert str(info.value).startswith(f"t.bad: task attribute {setting}")


@pytest.mark.parametrize(
    "attrs",
    [
        {"reject_on_worker_lost": True, "exactonce_rerun": True},
        {"exactonce_dispatch_timeout": 60.5},
        {"exactonce_dispatch_deadline": 300},
        {"exactonce_running_timeout": 95},
        {"exactonce_dispatch_timeout": 900, "exactonce_dispatch_deadline": 900},
    ],
    ids=["rerun", "dispatch_timeout", "deadline", "running", "both"],
)
def test_a_gated_task_at_the_edge_of_each_rule_is_accepted(
    world: World, attrs: dict[str, Any]
) -> None:
    world.app.task(base=ExactOnceTask, shared=False, name="t.edge", **attrs)(declared_body)
    validate_gated_task(world.app.tasks["t.edge"])


def test_a_refused_task_is_refused_again_until_it_is_fixed(world: World) -> None:
    task = world.task("t.careless")
    for _ in range(2):
        with pytest.raises(ConfigurationError, match="reject_on_worker_lost"):
            validate_gated_task(task)
    task.exactonce_rerun = True
    validate_gated_task(task)


def test_the_gate_runs_nothing_of_a_task_it_refuses(world: World) -> None:
    job = world.put(State.DISPATCHED, "t.careless")
    task = world.task("t.careless")
    headers = message_headers(job, NAMESPACE)
    task.push_request(
        id=job.ref.id,
        args=[1, 2],
        kwargs={},
        retries=0,
        headers=headers,
        is_eager=False,
        called_directly=False,
        delivery_info={"redelivered": False},
        **headers,
    )
    try:
        with pytest.raises(ConfigurationError, match="reject_on_worker_lost"):
            task(1, 2)
    finally:
        task.pop_request()
    assert world.runs == [] and world.job(job.ref.id) == job


# -- when a job is due, and when it expires --------------------------------------------------


def test_no_eta_and_no_countdown_is_due_now() -> None:
    assert eta_of({}) is None
    assert eta_of({"eta": None, "countdown": None}) is None


@pytest.mark.parametrize(
    ("eta", "instant"),
    [
        (datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC), datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)),
        (datetime(2030, 1, 2, 3, 4, 5), datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)),
        ("2030-01-02T03:04:05+00:00", datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)),
        ("2030-01-02T05:04:05+02:00", datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)),
        ("2030-01-02T03:04:05", datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)),
    ],
    ids=["aware", "naive-is-utc", "iso", "iso-offset", "iso-naive-is-utc"],
)
def test_an_eta_is_an_aware_instant(eta: Any, instant: datetime) -> None:
    found = eta_of({"eta": eta})
    assert found == instant and found.tzinfo is not None


def test_a_countdown_counts_from_now() -> None:
    before = datetime.now(UTC)
    found = eta_of({"countdown": 90})
    after = datetime.now(UTC)
    assert found is not None
    assert before + timedelta(seconds=90) <= found <= after + timedelta(seconds=90)
    assert near(eta_of({"countdown": "2.5"}), datetime.now(UTC) + timedelta(seconds=2.5))


def test_an_eta_wins_over_a_countdown() -> None:
    eta = datetime(2030, 1, 1, tzinfo=UTC)
    assert eta_of({"eta": eta, "countdown": 5}) == eta


def test_no_expires_is_no_deadline() -> None:
    assert deadline_of(None) is None


def test_an_expires_instant_is_the_deadline_naive_as_utc() -> None:
    at = datetime(2030, 1, 1, 12, tzinfo=UTC)
    assert deadline_of(at) == at
    naive = deadline_of(datetime(2030, 1, 1, 12))
    assert naive == at and naive.tzinfo is not None


def test_expires_in_seconds_counts_from_now_without_an_eta() -> None:
    before = datetime.now(UTC)
    found = deadline_of(30)
    after = datetime.now(UTC)
    assert found is not None
    assert before + timedelta(seconds=30) <= found <= after + timedelta(seconds=30)
    assert near(deadline_of("45"), datetime.now(UTC) + timedelta(seconds=45))


def test_expires_in_seconds_counts_from_the_call_not_the_eta(world: World) -> None:
    """As plain Celery does: ``countdown=60, expires=30`` expires before it is due.

    Fails before the fix: the deadline was 30 s after the eta, so the job ran.
    """
    before = datetime.now(UTC)
    result = world.task("t.add").apply_async((1, 2), countdown=60, expires=30)
    after = datetime.now(UTC)
    job = world.job(result.id)
    assert job.run_at is not None and job.deadline is not None
    assert before + timedelta(seconds=30) <= job.deadline <= after + timedelta(seconds=30)
    assert job.deadline < job.run_at


def test_an_iso_expires_is_the_deadline_as_celery_takes_it() -> None:
    """Fails before the fix: a str ``expires`` was read as seconds (``ValueError``)."""
    assert deadline_of("2030-01-01T12:00:00+00:00") == datetime(2030, 1, 1, 12, tzinfo=UTC)
    assert deadline_of("2030-01-01T12:00:00Z") == datetime(2030, 1, 1, 12, tzinfo=UTC)


def test_a_countdown_waits_pending_with_its_run_at_and_publishes_nothing(world: World) -> None:
    before = datetime.now(UTC)
    result = world.task("t.add").apply_async((1, 2), countdown=60)
    after = datetime.now(UTC)
    job = world.job(result.id)
    assert job.state is State.PENDING and job.reason == "apply_async (delayed)"
    assert job.run_at is not None
    assert before + timedelta(seconds=60) <= job.run_at <= after + timedelta(seconds=60)
    assert job.deadline is None and world.sent == []


def test_a_naive_eta_is_stored_as_utc(world: World) -> None:
    due = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=1)
    result = world.task("t.add").apply_async((1, 2), eta=due.replace(tzinfo=None))
    job = world.job(result.id)
    assert job.state is State.PENDING and job.run_at == due


@pytest.mark.parametrize("how", ["eta in the past", "countdown 0", "negative countdown"])
def test_a_job_due_already_is_published_at_once(world: World, how: str) -> None:
    options = {
        "eta in the past": {"eta": datetime.now(UTC) - timedelta(hours=1)},
        "countdown 0": {"countdown": 0},
        "negative countdown": {"countdown": -30},
    }[how]
    result = world.task("t.add").apply_async((1, 2), **options)
    job = world.job(result.id)
    assert job.state is State.DISPATCHED and job.run_at is None
    assert [task_id for task_id, _ in world.sent] == [result.id]


def test_a_delayed_job_that_expires_before_its_run_at_is_cancelled_not_sent(
    world: World,
) -> None:
    """Fails before the fix: the deadline was ``expires`` after the run_at, so it was sent."""
    result = world.task("t.add").apply_async((1, 2), countdown=60, expires=0)
    job = world.job(result.id)
    claim = Transition(State.SCHEDULED, frozenset({State.PENDING}), node="n", reason="sweep")
    claimed = world.store.transition(job.ref, claim).job
    assert claimed is not None and claimed.state is State.SCHEDULED
    outcome = runtime.runtime_for(world.app).dispatcher.dispatch(claimed).outcome
    assert outcome is Outcome.EXPIRED
    assert world.job(result.id).state is State.CANCELLED and world.sent == []


def test_an_expires_instant_is_the_jobs_deadline(world: World) -> None:
    at = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=2)
    result = world.task("t.add").apply_async((1, 2), expires=at)
    job = world.job(result.id)
    assert job.deadline == at and job.state is State.DISPATCHED
    (_, headers) = world.sent[-1]
    assert datetime.fromisoformat(headers["expires"]) == at


# -- the options stored with a job -----------------------------------------------------------


def test_options_of_the_call_alone_and_unset_ones_are_not_stored() -> None:
    local = {
        "producer": object(),
        "connection": object(),
        "router": object(),
        "publisher": object(),
        "retry": True,
        "retry_policy": {"max_retries": 3},
        "countdown": 5,
        "eta": datetime(2030, 1, 1, tzinfo=UTC),
        "expires": 30,
        "task_id": "x",
        "retries": 2,
        "result_cls": object,
        "add_to_parent": False,
    }
    kept = {"queue": "q1", "priority": 5, "ignore_result": False, "headers": {"h": 1}}
    assert storable_options({**local, **kept, "routing_key": None}) == kept


def test_a_kombu_queue_and_exchange_are_stored_by_name() -> None:
    exchange = Exchange("x1", type="topic")
    stored = storable_options({"queue": Queue("q1", exchange), "exchange": exchange})
    assert stored == {"queue": "q1", "exchange": "x1"}


def test_a_submitted_job_stores_what_each_dispatch_needs_and_no_more(world: World) -> None:
    result = world.task("t.add").apply_async(
        (1, 2), queue=Queue("q1"), priority=3, countdown=60, expires=600, retry=True
    )
    options = world.job(result.id).options
    assert options["queue"] == "q1" and options["priority"] == 3
    assert options["reply_to"] == world.app.thread_oid
    assert not {"countdown", "eta", "expires", "retry", "task_id"} & set(options)


# -- revoke and expires seen by a worker -----------------------------------------------------


class _Request:
    """What Celery's worker hands ``task_revoked`` receivers: a request with headers."""

    def __init__(self, task_id: str, headers: dict[str, Any], retries: int = 0) -> None:
        self.id = task_id
        self.retries = retries
        self.request_dict = {"headers": headers, **headers}


def revoke(
    world: World, task: str, job: Job, *, terminated: bool = False, expired: bool = False
) -> None:
    """A worker drops the message of ``job`` (its current attempt) as revoked or expired."""
    request = _Request(job.ref.id, message_headers(job, NAMESPACE), retries=job.attempt)
    signals.task_revoked.send(
        sender=world.app.tasks[task], request=request, terminated=terminated, expired=expired
    )


@pytest.mark.parametrize(("expired", "reason"), [(False, "revoked"), (True, "expired")])
def test_a_revoked_or_expired_message_cancels_its_waiting_job(
    world: World, expired: bool, reason: str
) -> None:
    job = world.put(State.DISPATCHED)
    revoke(world, "t.add", job, expired=expired)
    cancelled = world.job(job.ref.id)
    assert cancelled.state is State.CANCELLED and cancelled.reason == reason


def test_a_running_job_is_cancelled_only_by_a_revoke_that_terminates_it(world: World) -> None:
    job = world.put(State.RUNNING)
    revoke(world, "t.add", job)
    assert world.job(job.ref.id) == job
    revoke(world, "t.add", job, terminated=True)
    cancelled = world.job(job.ref.id)
    assert cancelled.state is State.CANCELLED and cancelled.run_id == job.run_id


def test_a_revoke_of_a_finished_job_changes_nothing(world: World) -> None:
    job = world.put(State.SUCCEEDED)
    revoke(world, "t.add", job, terminated=True)
    assert world.job(job.ref.id) == job


def test_a_revoke_seen_by_another_task_or_a_plain_one_changes_nothing(world: World) -> None:
    job = world.put(State.DISPATCHED)
    revoke(world, "t.other", job)
    revoke(world, "t.plain", job)
    assert world.job(job.ref.id) == job
    # A plain task's job is not the gate's to settle, even under its own task's name
    plain = world.put(State.DISPATCHED, "t.plain")
    revoke(world, "t.plain", plain)
    assert world.job(plain.ref.id) == plain


def test_a_revoked_beat_occurrence_cancels_the_occurrence(world: World) -> None:
    ref = JobRef.occurrence("every-minute@2026-03-01T00:00:00+00:00")
    job = world.put(State.DISPATCHED, ref=ref)
    twin = world.put(State.DISPATCHED, ref=JobRef.submitted(ref.id))  # a task job of the same id
    revoke(world, "t.add", job)
    occurrence = world.store.get(ref)
    assert occurrence is not None and occurrence.state is State.CANCELLED
    assert world.job(twin.ref.id) == twin


def test_a_revoke_that_loses_the_race_to_the_gate_changes_nothing(world: World) -> None:
    job = world.put(State.DISPATCHED)
    ran: list[Job] = []

    def the_gate_runs_it() -> None:
        ran.append(move(world.store, job, State.RUNNING))

    # Given the gate moves the job to RUNNING between the receiver's read and its write
    world.store.before_transition = the_gate_runs_it
    revoke(world, "t.add", job)
    # Then the revoke, written on the rev it read, is refused: the run stands
    (running,) = ran
    assert world.job(job.ref.id) == running and running.state is State.RUNNING


def test_a_revoke_the_store_cannot_record_is_logged_and_not_raised(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    job = world.put(State.DISPATCHED)
    world.store.down = True
    with caplog.at_level(logging.WARNING, logger="celery_exactonce"):
        revoke(world, "t.add", job)
    world.store.down = False
    assert world.job(job.ref.id) == job
    actions = [getattr(record, "action", None) for record in caplog.records]
    assert actions == ["revoke_write_failed"]


def test_a_run_a_revoke_terminated_stays_cancelled_its_outcome_noted_late(world: World) -> None:
    # Given a body that is revoked with terminate while it runs, and returns all the same
    def revoked_mid_run(self: Any) -> None:
        world.runs.append(self.name)
        revoke(world, self.name, world.job(self.request.id), terminated=True)

    world.app.task(base=ExactOnceTask, shared=False, bind=True, name="t.revoked")(revoked_mid_run)
    job = world.put(State.DISPATCHED, "t.revoked")
    task = world.task("t.revoked")
    headers = message_headers(job, NAMESPACE)
    task.push_request(
        id=job.ref.id,
        args=[],
        kwargs={},
        retries=0,
        headers=headers,
        is_eager=False,
        called_directly=False,
        delivery_info={"redelivered": False},
        **headers,
    )
    try:
        task()
    finally:
        task.pop_request()
    # Then the job stays CANCELLED: its outcome came too late, and is a note in the record
    final = world.job(job.ref.id)
    assert world.runs == ["t.revoked"] and final.state is State.CANCELLED
    revoked = [h.reason for h in final.history if (h.src, h.dst) == (State.RUNNING, final.state)]
    assert revoked == ["revoked"]
    note = final.history[-1]
    assert note.src is note.dst is State.CANCELLED
    assert note.reason.startswith("late outcome of run") and "SUCCEEDED" in note.reason
