"""The gate's send-back when the broker refuses the copy too, on a real Redis store.

The store is a :class:`~celery_exactonce.stores.redis.store.RedisStore` on the
test Redis; its answers are lost or refused by wrapping its calls (the
writes still apply on Redis), and the broker's refusal of the sent-back copy
is injected on the task's ``apply_async``. Each test hands the gate one
delivery as Celery's worker does (:func:`~tests.support.deliveries.deliver_to`).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from celery import Celery
from kombu.exceptions import OperationalError

from celery_exactonce import StoreUnavailable, runtime
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.dispatch.messages import GATED_OPTION, message_headers
from celery_exactonce.observe import metrics
from celery_exactonce.stores.redis.store import RedisStore
from celery_exactonce.task.base import ExactOnceTask
from tests import services
from tests.support.deliveries import deliver_to


@dataclass
class World:
    app: Celery
    store: RedisStore
    task: ExactOnceTask
    runs: list[int] = field(default_factory=list)
    #: Set: every read and write of the store fails (the writes do not apply).
    down: threading.Event = field(default_factory=threading.Event)
    #: The next gate write applies on Redis, then its answer is lost (and the store goes down).
    lose_next_write: bool = False
    #: Copies the broker refused (their headers).
    refused: list[dict[str, Any]] = field(default_factory=list)
    #: Whether the store comes back when the broker refuses a copy.
    back_on_refusal: bool = True
    #: What the first run of the body does before it returns (a copy delivered meanwhile).
    during_body: Any = None
    #: What each delivery of a copy became (ran, ignored...).
    copies: list[str] = field(default_factory=list)


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    services.need("redis")
    namespace = f"sendback-{uuid.uuid4().hex[:8]}"
    app = Celery("sendback", broker="memory://", set_as_current=False)
    app.conf.update(
        exactonce_store_url="memory://",
        exactonce_namespace=namespace,
        exactonce_retry_delay_store=0.01,
    )
    store = RedisStore.from_url(services.REDIS_URL, namespace=namespace, retention=3600)
    runtime.install(app, store)

    @app.task(base=ExactOnceTask, shared=False, bind=True, name="t.body", acks_late=True)
    def body(self: Any, *args: Any) -> str:
        world.runs.append(self.request.retries)
        during, world.during_body = world.during_body, None
        if during is not None:
            during()
        return "done"

    assert isinstance(body, ExactOnceTask)
    body.exactonce_gate_timeout = 0.2
    world = World(app, store, body)
    real_many, real_get = store.transition_many, store.get

    def transition_many(items: Any, *, brief: bool = False) -> Any:
        if world.down.is_set():
            raise StoreUnavailable("injected: store down")
        results = real_many(items, brief=brief)
        if world.lose_next_write:
            world.lose_next_write = False
            world.down.set()
            raise StoreUnavailable("injected: applied, answer lost")
        return results

    def get(ref: JobRef) -> Job | None:
        if world.down.is_set():
            raise StoreUnavailable("injected: store down")
        return real_get(ref)

    def refuse(*args: Any, **options: Any) -> Any:
        world.refused.append(dict(options.get("headers") or {}))
        if world.back_on_refusal:
            world.down.clear()
        raise OperationalError("injected: the broker refused the copy")

    monkeypatch.setattr(store, "transition_many", transition_many)
    monkeypatch.setattr(store, "get", get)
    monkeypatch.setattr(body, "apply_async", refuse)
    metrics.COUNTERS.reset()
    try:
        yield world
    finally:
        world.down.clear()
        store.drop_namespace()
        runtime.reset(app)


def dispatched(world: World) -> Job:
    """A ``DISPATCHED`` job of ``t.body`` (its message is what a test delivers)."""
    created = world.store.create(
        NewJob(
            JobRef.submitted(uuid.uuid4().hex),
            "t.body",
            State.SCHEDULED,
            node="n",
            args=[1],
            options={GATED_OPTION: True},
        )
    )
    assert created.job is not None
    request = Transition(
        State.DISPATCHED, frozenset({State.SCHEDULED}), node="n", reason="t", rev=created.job.rev
    )
    result = world.store.transition(created.job.ref, request)
    assert result.applied and result.job is not None
    return result.job


def test_scenario_37_a_send_back_the_broker_refuses_keeps_the_delivery_until_the_store_answers(
    world: World,
) -> None:
    """The gate write applied, its answer lost; the store stays down past the gate's
    timeout, and the broker refuses the copy: the delivery still runs the attempt once.

    Before the fix, the refused send-back ended in ``Reject(requeue=True)``,
    which gives the message back without its tickets: the delivery that came
    back found the job ``RUNNING`` under a run id it did not hold and was
    refused, and the job could only end ``TIMEOUT``, its body never run.
    """
    job = dispatched(world)
    world.lose_next_write = True
    outcome = deliver_to(world.task, job.ref.id, message_headers(job, world.store.namespace))
    assert len(world.refused) == 1  # the store came back once the broker refused the copy
    assert outcome == "ran"
    assert world.runs == [0]
    final = world.store.get(job.ref)
    assert final is not None and final.state is State.SUCCEEDED
    assert metrics.COUNTERS.get("gate_send_back_failed") == 1


def test_scenario_37_store_and_broker_both_unreachable_give_the_message_back_counted(
    world: World,
) -> None:
    """Neither the store nor the broker answers: the gate tries both again for another
    ``exactonce_gate_timeout``, then gives the message back, at ERROR and counted.

    Before the fix, the first refusal of the copy gave the message back at
    once (one send-back tried, a warning), without trying the store again.
    """
    job = dispatched(world)
    world.back_on_refusal = False
    world.down.set()
    outcome = deliver_to(world.task, job.ref.id, message_headers(job, world.store.namespace))
    assert outcome == "requeued"
    assert world.runs == []
    assert len(world.refused) >= 2
    assert metrics.COUNTERS.get("gate_gave_up") == 1
    world.down.clear()
    current = world.store.get(job.ref)
    assert current is not None and current.state is State.DISPATCHED  # nothing applied


def test_scenario_37_a_refused_copy_that_landed_all_the_same_never_runs_the_attempt_twice(
    world: World,
) -> None:
    """The broker raised on the copy, yet has it (a publish whose answer was lost): the
    copy, delivered while the original delivery's body runs, is refused.

    The original delivery, which goes on after the refusal, runs under a fresh
    run id, taking over its own earlier one (now a ticket of the copy). The
    copy holds a ticket no longer current: it cannot take the run over.
    """
    job = dispatched(world)
    world.lose_next_write = True

    def copy_arrives() -> None:
        (copy,) = world.refused
        world.copies.append(deliver_to(world.task, job.ref.id, copy, redelivered=True))

    world.during_body = copy_arrives
    outcome = deliver_to(world.task, job.ref.id, message_headers(job, world.store.namespace))
    assert (outcome, world.copies, world.runs) == ("ran", ["ignored"], [0])
    final = world.store.get(job.ref)
    assert final is not None and final.state is State.SUCCEEDED
    assert [h.reason for h in final.history if h.dst is State.RUNNING] == [
        "gate",
        "gate: taken over from a delivery sent back",
    ]
