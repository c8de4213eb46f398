"""Bad input is refused before anything is stored, naming the culprit; what kombu's JSON
can carry is stored so that the worker gets exactly what plain Celery would deliver.

Beat entries are checked at ``setup_schedule`` (and when added at run time); an
``apply_async`` call is checked before its record is written; the dispatch path
settles a message it cannot build as ``FAILED``, never as ambiguous.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest
from celery import Celery
from kombu.utils import json as kombu_json

from celery_exactonce import ConfigurationError, ExactOnceTask, InvalidPayload, runtime
from celery_exactonce.core.payload import decode_payload
from celery_exactonce.core.refs import MAX_REASON_LENGTH, JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.dispatch.dispatcher import Dispatcher
from celery_exactonce.dispatch.messages import GATED_OPTION
from celery_exactonce.dispatch.outcomes import Outcome
from celery_exactonce.dispatch.publisher import CeleryPublisher
from celery_exactonce.observe import metrics
from celery_exactonce.testing import InMemoryStore
from tests.support.beat_cluster import Cluster, every, isolated, refused_at_start

#: Values kombu's JSON serializer carries with a type marker, as plain Celery sends them.
TYPED_ARGS = [
    datetime(2026, 5, 4, 3, 2, 1, 123456, tzinfo=timezone.utc),
    datetime(2026, 5, 4, 3, 2, 1),  # naive: delivered naive
    Decimal("1.10"),
]
TYPED_KWARGS = {"u": uuid.UUID("12345678-1234-5678-1234-567812345678"), "b": b"\xff\x00raw"}


@pytest.fixture(autouse=True)
def _counters_and_signals() -> Iterator[None]:
    with isolated():
        yield


def delivered(value: Any) -> Any:
    """What a plain Celery worker gets for ``value`` sent with the json serializer."""
    return kombu_json.loads(kombu_json.dumps(value))


# -- reasons (issue 11 item 14) ----------------------------------------------------------


def test_every_reason_is_made_storable_and_capped() -> None:
    """Fails before the fix: a reason over the limit was refused (``InvalidPayload``) and
    one with a lone surrogate or NUL went to the store as it was."""
    reason = "OSError: " + b"\xff".decode("utf-8", "surrogateescape") + "\x00\t\r\n" + "x" * 600
    request = Transition(
        State.FAILED, frozenset({State.RUNNING}), node="n", reason=reason, run_id="r"
    )
    assert request.reason.startswith("OSError: \ufffd\ufffd\t\r\nxxx")
    assert len(request.reason) == MAX_REASON_LENGTH and request.reason.endswith("…")
    new = NewJob(JobRef.submitted("j"), "t", State.SCHEDULED, node="n", reason=reason)
    assert new.reason == request.reason


# -- beat entries (issue 11 item 12/13, SCENARIOS 70) --------------------------------------


def test_beat_entry_with_kombu_typed_arguments_is_claimed_and_keeps_its_values() -> None:
    """SCENARIOS 70: a datetime/Decimal/UUID/bytes argument, which plain beat's JSON carries.

    Fails before the fix: the claim's ``NewJob`` refused the payload inside the tick,
    which raised out of ``tick()`` (beat died at the entry's first due slot).
    """
    schedule = {
        "typed": {
            "task": "plain.t",
            "schedule": timedelta(seconds=1),
            "args": TYPED_ARGS,
            "kwargs": TYPED_KWARGS,
        },
        "other": every(1),
    }
    cluster = Cluster(schedule, nodes=2)
    cluster.run(3)
    typed = [job for job in cluster.broker.sent if job.entry == "typed"]
    assert len(typed) == 3 and len(cluster.fired("other")) == 3
    # What the publish hands to send_task is what plain Celery would have sent
    for job in typed:
        assert decode_payload(job.args) == delivered(TYPED_ARGS) == TYPED_ARGS
        assert decode_payload(job.kwargs) == delivered(TYPED_KWARGS) == TYPED_KWARGS


BAD_ENTRIES: dict[str, tuple[str, dict[str, Any], str]] = {
    # id: (entry name, entry, what the error must say besides the entry's name)
    "object-argument": ("obj-arg", {"args": [object()]}, "args"),
    "nan-argument": ("nan-arg", {"kwargs": {"x": float("nan")}}, "kwargs"),
    "unknown-type-marker": (
        "marker-arg",
        {"args": [{"__type__": "nope", "__value__": 1}]},
        "args",
    ),
    "long-name": ("n" * 300, {}, "over 255"),
    "control-character-name": ("bad\nname", {}, "control"),
    "long-task-name": ("long-task", {"task": "t" * 300}, "task name"),
    "retry-option": ("retry-opt", {"options": {"retry": True}}, "'retry'"),
    "retries-option": ("retries-opt", {"options": {"retries": 2}}, "'retries'"),
    "task-id-option": ("task-id-opt", {"options": {"task_id": "x"}}, "'task_id'"),
    "headers-not-a-dict": ("headers-opt", {"options": {"headers": "x"}}, "'headers'"),
    "option-not-json": ("queue-opt", {"options": {"priority": object()}}, "options"),
}


@pytest.mark.parametrize("case", list(BAD_ENTRIES), ids=list(BAD_ENTRIES))
def test_bad_beat_entry_is_refused_at_start_naming_it(case: str) -> None:
    """SCENARIOS 70: refused by ``setup_schedule``, before any tick, naming the entry.

    Fails before the fix: the scheduler started, and the entry's first claim or
    publish raised inside a tick (killing beat on every node), or was classified
    as an ambiguous publish (``retry``, ``retries``), its occurrence never run.
    """
    name, fields, says = BAD_ENTRIES[case]
    entry = {"task": "plain.t", "schedule": timedelta(seconds=1), **fields}
    with refused_at_start() as refusal:
        Cluster({"good": every(1), name: entry}, nodes=1)
    message = str(refusal[0])
    assert repr(name)[:30] in message and says in message, message
    assert refusal[0].setting == "beat_schedule"


def test_a_refused_node_leaves_the_running_nodes_and_the_store_alone() -> None:
    """SCENARIOS 70: the refusal stops only the node started with the bad entry."""
    cluster = Cluster({"good": every(1)}, nodes=2)
    cluster.run(2)
    before = {ref: job.rev for ref, job in cluster.store._jobs.items()}
    with refused_at_start("bad-arg"):
        cluster.add_node({"good": every(1), "bad-arg": {**every(1), "args": [object()]}})
    after = {ref: job.rev for ref, job in cluster.store._jobs.items()}
    assert after == before
    cluster.run(2)
    assert len(cluster.fired("good")) == 4


def test_a_bad_entry_added_at_run_time_is_refused_and_the_old_one_kept() -> None:
    """Fails before the fix: ``add``/``update_from_dict`` kept the bad entry; the next
    tick raised on it."""
    cluster = Cluster({"a": every(1)}, nodes=1)
    node = cluster.nodes[0]
    old = node.schedule["a"]
    with pytest.raises(ConfigurationError, match=r"'a'.*'retries'"):
        node.update_from_dict({"a": {**every(1), "options": {"retries": 3}}})
    with pytest.raises(ConfigurationError, match=r"'fresh'.*args"):
        node.add(name="fresh", task="plain.t", schedule=timedelta(seconds=1), args=[object()])
    assert node.schedule["a"] is old and "fresh" not in node.schedule
    cluster.run(2)
    assert len(cluster.fired("a")) == 2


# -- the dispatch path (issue 11 item 13) -------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [{"retries": 2}, {"retry": True}, {"headers": "not a dict"}, {"producer": "p"}],
    ids=["retries", "retry", "headers", "producer"],
)
def test_a_stored_option_send_task_cannot_take_fails_the_job_definitely(
    options: dict[str, Any],
) -> None:
    """A record stored before options were checked: ``FAILED`` with the reason, at once.

    Fails before the fix: ``TypeError`` (a keyword given twice) was an ambiguous publish
    (the job stayed ``DISPATCHED`` and never ran) and ``headers`` raised out of dispatch.
    """
    store = InMemoryStore("ns")
    new = NewJob(
        JobRef.submitted("j"),
        "tasks.t",
        State.SCHEDULED,
        node="n",
        options={GATED_OPTION: False, **options},
    )
    job = store.create(new).job
    assert job is not None
    app = Celery("pub", broker="memory://", set_as_current=False)
    result = Dispatcher(store, CeleryPublisher(app), node="n").dispatch(job)
    assert result.outcome is Outcome.FAILED
    stored = store.get(job.ref)
    assert stored is not None and stored.state is State.FAILED
    assert next(iter(options)) in stored.reason
    assert metrics.COUNTERS.get("publish_ambiguous") == 0


def test_celery_publisher_sends_what_plain_celery_would(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stored kombu-typed values go to ``send_task`` as the Python values they were."""
    store = InMemoryStore("ns")
    new = NewJob(
        JobRef.submitted("typed"),
        "tasks.t",
        State.SCHEDULED,
        node="n",
        args=TYPED_ARGS,
        kwargs=TYPED_KWARGS,
        options={GATED_OPTION: False},
    )
    job = store.create(new).job
    assert job is not None and store.get(job.ref) == job
    app = Celery("pub", broker="memory://", set_as_current=False)
    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(app, "send_task", lambda name, **options: sent.append(options))
    Dispatcher(store, CeleryPublisher(app), node="n").dispatch(job)
    assert sent[0]["args"] == TYPED_ARGS and sent[0]["kwargs"] == TYPED_KWARGS
    assert [type(a) for a in sent[0]["args"]] == [type(a) for a in TYPED_ARGS]


# -- apply_async (issue 11 item 13) -------------------------------------------------------


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("submit", broker="memory://", set_as_current=False)
    app.conf.update(exactonce_store_url="memory://", task_serializer="json")
    runtime.install(app, InMemoryStore("submit"))

    @app.task(base=ExactOnceTask, shared=False, name="t.add")
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(base=ExactOnceTask, shared=False, name="t.any")
    def anything(*args: Any, **kwargs: Any) -> None:
        return None

    yield app
    runtime.reset(app)


def stored(app: Celery, task_id: str) -> Any:
    return runtime.runtime_for(app).store.get(JobRef.submitted(task_id))


@pytest.mark.parametrize(
    ("call", "error", "says"),
    [
        ({"args": (1, 2, 3)}, TypeError, "argument"),
        ({"args": (1,), "kwargs": {"z": 1}}, TypeError, "argument"),
        ({"args": (1, 2), "headers": "x"}, InvalidPayload, "headers"),
        ({"args": (1, 2), "headers": {"h": object()}}, InvalidPayload, "options"),
        ({"args": (1, 2), "priority": object()}, InvalidPayload, "options"),
        ({"args": (object(), 2)}, InvalidPayload, "args"),
    ],
    ids=["too-many", "unknown-kwarg", "headers-str", "headers-value", "option-value", "arg"],
)
def test_apply_async_refuses_bad_calls_before_storing_anything(
    app: Celery, call: dict[str, Any], error: type[Exception], says: str
) -> None:
    """Fails before the fix: a wrong number of arguments was stored and dispatched
    (Celery's own argument check skipped); a non-dict ``headers`` raised from the
    publish after the record existed."""
    task_id = uuid.uuid4().hex
    with pytest.raises(error, match=says):
        app.tasks["t.add"].apply_async(task_id=task_id, **call)
    assert stored(app, task_id) is None


def test_apply_async_takes_kombu_typed_arguments(app: Celery) -> None:
    """Bytes, datetime, UUID and Decimal arguments, as plain ``apply_async`` takes them.

    Fails before the fix: ``InvalidPayload`` (not JSON).
    """
    task_id = uuid.uuid4().hex
    app.tasks["t.any"].apply_async(TYPED_ARGS, TYPED_KWARGS, task_id=task_id)
    job = stored(app, task_id)
    assert job is not None and job.state is State.DISPATCHED
    assert decode_payload(job.args) == TYPED_ARGS
    # Resubmitting the same call is the same job, not a conflict
    app.tasks["t.any"].apply_async(TYPED_ARGS, TYPED_KWARGS, task_id=task_id)


# -- claim conflicts (issue 11 item 16, SCENARIOS 57 and 52) ------------------------------


def test_same_entry_name_with_another_task_is_reported_once_as_a_conflict(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SCENARIOS 57: two apps on one namespace, one entry name, different tasks.

    Fails before the fix: the loser's task never ran and only a debug
    "already claimed" line said so.
    """
    cluster = Cluster({"report": every(1, task="app_a.report")}, nodes=1)
    cluster.add_node({"report": every(1, task="app_b.report")})
    with caplog.at_level(logging.WARNING, logger="celery_exactonce"):
        cluster.run(10)
    assert metrics.COUNTERS.get("claim_conflict") == 1  # once per entry, not per tick
    (record,) = [r for r in caplog.records if getattr(r, "action", "") == "claim_conflict"]
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert "report" in message and "app_a.report" in message and "app_b.report" in message
    assert record.claimed_by == runtime.runtime_for(cluster.app).node  # type: ignore[attr-defined]
    # and the record that won the slot says it, in a note of its history
    job = cluster.store.get(JobRef.occurrence(record.job_id))  # type: ignore[attr-defined]
    assert job is not None and job.task == "app_a.report"
    (note,) = [h for h in job.history if h.reason.startswith("claim conflict")]
    assert "app_b.report" in note.reason and note.src is note.dst


def test_same_entry_with_other_arguments_is_a_conflict_too() -> None:
    """SCENARIOS 57, arguments: the same task with different args is another job too."""
    cluster = Cluster({"r": {**every(1), "args": [1]}}, nodes=1)
    cluster.add_node({"r": {**every(1), "args": [2]}})
    cluster.run(5)
    assert metrics.COUNTERS.get("claim_conflict") == 1


def test_same_entry_same_definition_is_no_conflict() -> None:
    cluster = Cluster({"r": {**every(1), "args": TYPED_ARGS}}, nodes=3)
    cluster.run(5)
    assert metrics.COUNTERS.get("claim_conflict") == 0


def test_nodes_with_different_schedules_still_dispatch_each_slot_once() -> None:
    """SCENARIOS 52: same namespace, different schedule definitions: one dispatch per
    (key, fire_time)."""
    cluster = Cluster({"tick": every(1), "a_only": every(2)}, nodes=1)
    cluster.add_node({"tick": every(2), "b_only": every(3)})
    cluster.add_node({"tick": every(1), "a_only": every(4), "b_only": every(3)})
    cluster.run(30)
    sent = [(job.entry, job.fire_time) for job in cluster.broker.sent]
    assert len(sent) == len(set(sent))
    assert len(cluster.fired("tick")) == 30
    assert {fire.second % 2 for fire in cluster.fired("a_only")} == {0}
    assert cluster.fired("b_only")
