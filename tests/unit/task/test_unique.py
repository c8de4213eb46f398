"""``exactonce_unique``: the key of a call, the refusals, and ``delay`` answered by the live job.

Jobs live in an InMemoryStore; what is published is read from ``before_task_publish``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from celery import Celery

from celery_exactonce import ConfigurationError, InvalidPayload, runtime
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import UNIQUE_OPTION
from celery_exactonce.observe import metrics
from celery_exactonce.task import unique
from celery_exactonce.task.base import ExactOnceTask
from celery_exactonce.task.gate import validate_gated_task
from celery_exactonce.testing import InMemoryStore
from tests.support.helpers import move
from tests.support.publishing import recording

NAMESPACE = "unique-unit"


@dataclass
class World:
    app: Celery
    store: InMemoryStore
    sent: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def task(self, name: str) -> Any:
        return self.app.tasks[name]


def sync(user_id: int, full: bool = False) -> None:
    """The unique task's body (never run here)."""


@pytest.fixture
def world() -> Iterator[World]:
    app = Celery("unique-unit", broker="memory://", set_as_current=False)
    app.conf.update(
        exactonce_store_url="memory://", exactonce_namespace=NAMESPACE, task_ignore_result=True
    )
    store = InMemoryStore(NAMESPACE)
    runtime.install(app, store)
    world = World(app, store)
    app.task(name="u.sync", base=ExactOnceTask, shared=False, exactonce_unique=("user_id",))(sync)
    app.task(
        name="u.bucket",
        base=ExactOnceTask,
        shared=False,
        exactonce_unique=lambda user_id, **_: user_id % 10,
    )(sync)
    app.task(name="u.plain", base=ExactOnceTask, shared=False)(sync)
    with recording(app, world.sent):
        yield world


def test_the_key_binds_the_call_as_python_does(world: World) -> None:
    task = world.task("u.sync")
    key = unique.key_of(task, (5,), {})
    assert key is not None and key.startswith("u:") and len(key) == 66
    assert unique.key_of(task, (), {"user_id": 5}) == key
    assert unique.key_of(task, (5, True), {}) == key  # only the names count
    assert unique.key_of(task, (6,), {}) != key
    other = world.task("u.bucket")
    assert unique.key_of(other, (15,), {}) == unique.key_of(other, (5,), {"full": True})
    assert unique.key_of(other, (5,), {}) != key  # the task's name is in the key
    assert unique.key_of(world.task("u.plain"), (5,), {}) is None


def test_a_key_of_values_that_are_not_json_is_refused_naming_the_task(world: World) -> None:
    with pytest.raises(InvalidPayload, match=r"u\.sync: the values of its exactonce_unique key"):
        unique.key_of(world.task("u.sync"), (object(),), {})
    with pytest.raises(InvalidPayload, match="cannot be made from this call: TypeError"):
        unique.key_of(world.task("u.sync"), (), {"nobody": 1})
    with pytest.raises(InvalidPayload, match="cannot be made from this call: TypeError"):
        unique.key_of(world.task("u.bucket"), (), {})  # the key function's own TypeError


def test_a_name_taken_by_kwargs_must_be_in_the_call(world: World) -> None:
    def loose(**kwargs: Any) -> None:
        """Takes anything."""

    task = world.app.task(
        name="u.loose", base=ExactOnceTask, shared=False, exactonce_unique=("user_id",)
    )(loose)
    validate_gated_task(task)  # a **kwargs takes any name
    assert unique.key_of(task, (), {"user_id": 5, "x": 1}) == unique.key_of(
        task, (), {"user_id": 5}
    )
    with pytest.raises(InvalidPayload, match="the call gives no 'user_id'"):
        unique.key_of(task, (), {"x": 1})


def test_a_caller_cannot_set_the_key_nor_a_replacement_hold_one(world: World) -> None:
    with pytest.raises(InvalidPayload, match="option 'exactonce_unique' cannot be set"):
        world.task("u.plain").apply_async((5,), exactonce_unique="mine")
    from celery_exactonce.task import submit

    sync_task = world.task("u.sync")
    replacing = submit.new_job(
        sync_task, "n", "t-1", (5,), None, link=None, link_error=None, shadow=None,
        options={"replaced_task_nesting": 1},
    )  # fmt: skip
    assert replacing.unique is None  # it stands in for the job it replaces


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("user_id", "give the names of the arguments"),
        ((), "give the names of the arguments"),
        (("user",), "'user' is not an argument of u.bad (it takes user_id, full)"),
        ((3,), "3 is not an argument"),
    ],
)
def test_a_wrong_spec_is_refused_at_start_up(world: World, spec: Any, says: str) -> None:
    task = world.app.task(name="u.bad", base=ExactOnceTask, shared=False, exactonce_unique=spec)(
        sync
    )
    with pytest.raises(ConfigurationError, match=r"u\.bad\.exactonce_unique") as refused:
        validate_gated_task(task)
    assert says in str(refused.value)


def test_a_live_job_answers_a_call_with_its_key(world: World) -> None:
    sync_task = world.task("u.sync")
    first = sync_task.delay(5)
    again = sync_task.delay(user_id=5, full=True)
    assert again.id == first.id
    assert [task_id for task_id, _ in world.sent] == [first.id]  # published once
    assert metrics.COUNTERS.get("unique_hit", task="u.sync") == 1
    job = world.store.get(JobRef.submitted(first.id))
    assert job is not None and job.options[UNIQUE_OPTION] == unique.key_of(sync_task, (5,), {})
    assert UNIQUE_OPTION not in world.sent[0][1]  # not sent with the message
    other = sync_task.delay(6)
    assert other.id != first.id
    for state in (State.RUNNING, State.SUCCEEDED):
        job = move(world.store, job, state)
    after = sync_task.delay(5)  # ended: a new job
    assert after.id not in (first.id, other.id)
    assert len(world.sent) == 3


def test_a_delayed_job_holds_its_key_until_it_ends(world: World) -> None:
    sync_task = world.task("u.sync")
    first = sync_task.apply_async((7,), countdown=3600)
    job = world.store.get(JobRef.submitted(first.id))
    assert job is not None and job.state is State.PENDING
    assert sync_task.delay(7).id == first.id
    assert world.sent == []  # nothing due, nothing published


def test_a_resubmitted_task_id_is_its_own_job_not_a_hit(world: World) -> None:
    sync_task = world.task("u.sync")
    first = sync_task.apply_async((8,), task_id="fixed-id")
    again = sync_task.apply_async((8,), task_id="fixed-id")
    assert again.id == first.id == "fixed-id"
    assert metrics.COUNTERS.get("unique_hit") == 0
    assert metrics.COUNTERS.get("resubmitted") == 1


def test_a_store_without_unique_keys_refuses_the_submit(world: World) -> None:
    class Plain(InMemoryStore):
        create_unique = None  # type: ignore[assignment]

    runtime.install(world.app, Plain(NAMESPACE))
    with pytest.raises(ConfigurationError, match=r"u\.sync\.exactonce_unique: the store"):
        world.task("u.sync").delay(5)
    assert world.sent == []


def test_a_hit_that_brought_links_warns_they_are_not_attached(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    sync_task = world.task("u.sync")
    first = sync_task.delay(9)
    with caplog.at_level("DEBUG", logger="celery_exactonce"):
        again = sync_task.apply_async((9,), link=world.task("u.plain").s())
    assert again.id == first.id
    (hit,) = [r for r in caplog.records if getattr(r, "action", None) == "unique_hit"]
    assert hit.levelname == "WARNING"
    assert "the call's link not attached" in hit.getMessage()
