"""A worker's sharded store finds a beat occurrence on the shard of the entry its message names.

A beat occurrence lives on its entry's shard (celery_exactonce/stores/redis/sharded.py).
The *worker-side* store here is a fresh :class:`ShardedRedisStore` that did not create
the job, so it does not know that shard: the message's ``exactonce_key`` (the ref's
``entry_hint``) tells it. The client counts what is sent: each command, with the
shard its key is on, one command being one round trip here (no pipeline is used).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, TypeVar

import fakeredis
import pytest
from celery import Celery

from celery_exactonce import runtime
from celery_exactonce.core.jobs import Job, TransitionStatus
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.dispatch.messages import HEADER_KEY, message_headers, ref_from_headers
from celery_exactonce.stores.redis.sharded import ShardedRedisStore
from celery_exactonce.stores.shards import shard_of
from celery_exactonce.task.base import ExactOnceTask
from tests.support.deliveries import deliver_to
from tests.support.helpers import move, occurrence, to
from tests.support.publishing import publishing

NAMESPACE = "routes"
SHARDS = 3
#: The shard of the entries here: the last one a search reads.
HOME = 2
FIRE = datetime(2026, 3, 1, tzinfo=timezone.utc)

T = TypeVar("T")

_SHARD = re.compile(r"\{[^}:]*:(\d+)(?:\.\d+)?\}")  # a shard tag: <ns>:<s> or <ns>:<s>.<k>


def entry_on(shard: int, stem: str = "nightly") -> str:
    """An entry key whose shard is ``shard``."""
    return next(name for i in itertools.count() if shard_of(name := f"{stem}-{i}", SHARDS) == shard)


class CountingRedis(fakeredis.FakeRedis):
    """A fakeredis client noting each command it sends: its name and its key's shard."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sent: list[tuple[str, int | None]] = []

    def execute_command(self, *args: Any, **options: Any) -> Any:
        name = str(args[0]).upper()
        key = args[3] if name == "EVALSHA" else args[1] if len(args) > 1 else ""
        found = _SHARD.search(key.decode() if isinstance(key, bytes) else str(key))
        self.sent.append((name, int(found.group(1)) if found else None))
        return super().execute_command(*args, **options)

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        self.sent.append(("PIPELINE", None))
        return super().pipeline(*args, **kwargs)


@dataclass
class World:
    client: CountingRedis
    beat: ShardedRedisStore
    app: Celery
    runs: list[str] = field(default_factory=list)

    def worker(self) -> ShardedRedisStore:
        """A store of a worker process: it created no job, it has read none."""
        return ShardedRedisStore(self.client, namespace=NAMESPACE, retention=3600.0, shards=SHARDS)

    def dispatched(self, entry: str, state: State = State.DISPATCHED) -> Job:
        """Beat's occurrence of ``entry`` (on beat's own store), moved on to ``state``."""
        created = self.beat.create(occurrence(entry, FIRE, task="t.body"))
        assert created.job is not None
        job = move(self.beat, created.job, State.DISPATCHED)
        return job if state is State.DISPATCHED else move(self.beat, job, state)

    def sent(self, do: Callable[[], T]) -> tuple[T, list[tuple[str, int | None]]]:
        """What ``do`` answers, and what it sends to Redis."""
        self.client.sent.clear()
        answer = do()
        return answer, list(self.client.sent)


@pytest.fixture
def world() -> Iterator[World]:
    client = CountingRedis()
    beat = ShardedRedisStore(client, namespace=NAMESPACE, retention=3600.0, shards=SHARDS)
    beat.setup()
    for script in beat._parts[0]._scripts.values():  # loaded, as on a server in use
        client.script_load(script.script)
    app = Celery("shard-routes", broker="memory://", set_as_current=False)
    app.conf.update(exactonce_store_url="memory://", exactonce_namespace=NAMESPACE)
    world = World(client, beat, app)

    @app.task(base=ExactOnceTask, shared=False, bind=True, name="t.body")
    def body(self: Any, *args: Any) -> str:
        world.runs.append(self.request.id)
        return "done"

    with publishing(app, lambda **_kw: None):
        yield world


def _ops(run_id: str | None) -> dict[str, Callable[[ShardedRedisStore, JobRef], object]]:
    """Each operation a worker does on a job by its ref, and what it answers when it applies."""
    finish = to(State.SUCCEEDED, State.RUNNING, run_id=run_id)
    return {
        "get": lambda store, ref: store.get(ref),
        "transition": lambda store, ref: store.transition(ref, finish).applied,
        "transition_many": lambda store, ref: (
            store.transition_many([(ref, finish)], brief=True)[0].applied
        ),
        "heartbeat": lambda store, ref: store.heartbeat(ref, run_id or ""),
        "annotate": lambda store, ref: store.annotate(ref, node="w", reason="note", op_id="op1"),
    }


OPS = list(_ops(None))
COMMAND = {"get": "HGETALL"}


@pytest.mark.parametrize("op", OPS)
def test_a_worker_store_goes_to_the_hinted_shard_alone(world: World, op: str) -> None:
    job = world.dispatched(entry_on(HOME), State.RUNNING)
    ref = ref_from_headers(message_headers(job, NAMESPACE), job.ref.id)
    assert ref == job.ref and ref.entry_hint == job.entry
    do = _ops(job.run_id)[op]
    answer, sent = world.sent(lambda: do(world.worker(), ref))
    assert answer  # applied (get: the record)
    assert sent == [(COMMAND.get(op, "EVALSHA"), HOME)]  # one round trip, no other shard


@pytest.mark.parametrize("op", OPS)
def test_without_a_hint_each_shard_is_read_in_turn(world: World, op: str) -> None:
    """The cost the hint saves: a worker store reads shard 0, 1, ... before it writes."""
    job = world.dispatched(entry_on(HOME), State.RUNNING)
    do = _ops(job.run_id)[op]
    answer, sent = world.sent(lambda: do(world.worker(), JobRef.occurrence(job.ref.id)))
    assert answer
    reads = [("HGETALL", 0), ("HGETALL", 1), ("HGETALL", 2)]
    assert sent == (reads if op == "get" else [*reads, ("EVALSHA", HOME)])


@pytest.mark.parametrize("op", OPS)
def test_a_wrong_hint_falls_back_to_the_search(world: World, op: str) -> None:
    job = world.dispatched(entry_on(HOME), State.RUNNING)
    wrong = JobRef.occurrence(job.ref.id, entry_on(0, "forged"))
    do = _ops(job.run_id)[op]
    store = world.worker()
    answer, sent = world.sent(lambda: do(store, wrong))
    assert answer  # found, and applied, as with the right hint
    # tried on the hinted shard (it answers "no such record"), then the search, then home
    search = [("HGETALL", 1), ("HGETALL", 2)]
    if op == "get":
        assert sent == [("HGETALL", 0), *search]
    else:
        assert sent == [("EVALSHA", 0), *search, ("EVALSHA", HOME)]
    # and the shard found is remembered: the next call goes there at once
    assert world.sent(lambda: store.get(wrong))[1] == [("HGETALL", HOME)]


def test_a_record_found_nowhere_is_not_found_and_nothing_is_written(world: World) -> None:
    ref = JobRef.occurrence("never-claimed", entry_on(HOME))
    store = world.worker()
    before = sorted(world.client.keys())
    gate = to(State.RUNNING, State.DISPATCHED, new_run_id="r")
    status, sent = world.sent(lambda: store.transition_many([(ref, gate)])[0].status)
    assert status is TransitionStatus.NOT_FOUND
    assert sent == [("EVALSHA", HOME), ("HGETALL", 0), ("HGETALL", 1)]  # tried, then searched
    assert store.transition(ref, gate).status is TransitionStatus.NOT_FOUND
    assert store.get(ref) is None and not store.heartbeat(ref, "r")
    assert not store.annotate(ref, node="w", reason="x", op_id="o")
    assert sorted(world.client.keys()) == before and ref not in store._known


@pytest.mark.parametrize("hint", ["", "x" * 256, "bad\x00key", 42, b"nightly-0", ["e"]])
def test_a_hint_that_is_not_an_entry_key_is_dropped(hint: Any) -> None:
    assert JobRef.occurrence("o1", hint).entry_hint is None
    forged = ref_from_headers({"exactonce_job_id": "o1", HEADER_KEY: hint}, "o1")
    assert forged == JobRef.occurrence("o1") and forged.entry_hint is None


def test_a_hint_is_no_part_of_the_identity_and_only_an_occurrence_keeps_one() -> None:
    hinted, plain = JobRef.occurrence("o1", "nightly"), JobRef.occurrence("o1")
    assert hinted.entry_hint == "nightly"
    assert hinted == plain and hash(hinted) == hash(plain) and {hinted: 1}[plain] == 1
    assert not hinted < plain and not plain < hinted
    assert str(hinted) == "o:o1" and repr(hinted) == repr(plain)
    assert JobRef.submitted("t1").entry_hint is None
    assert JobRef.parse("t:t1") == JobRef(JobRef.submitted("t1").space, "t1", "nightly")
    assert JobRef(JobRef.submitted("t1").space, "t1", "nightly").entry_hint is None


def _deliver(world: World, store: ShardedRedisStore, job: Job, **headers: Any) -> str:
    runtime.install(world.app, store)
    gated = world.app.tasks["t.body"]
    assert isinstance(gated, ExactOnceTask)
    message = {**message_headers(job, NAMESPACE), **headers}
    return deliver_to(gated, job.ref.id, message)


def test_the_gate_of_a_beat_occurrence_writes_on_its_shard_alone(world: World) -> None:
    job = world.dispatched(entry_on(HOME))
    store = world.worker()
    outcome, sent = world.sent(lambda: _deliver(world, store, job))
    # the gate's CAS and the completion: two round trips, on the job's shard, no read
    assert outcome == "ran" and world.runs == [job.ref.id]
    assert sent == [("EVALSHA", HOME), ("EVALSHA", HOME)]
    done = world.beat.get(job.ref)
    assert done is not None and done.state is State.SUCCEEDED
    # a redelivery is refused on the record found at once: the body ran once
    assert _deliver(world, world.worker(), job) == "ignored" and world.runs == [job.ref.id]


def test_the_gate_behaves_alike_with_a_wrong_hint_a_forged_one_and_none(world: World) -> None:
    outcomes: dict[str, list[object]] = {}
    for name, forged in (("right", None), ("wrong", entry_on(0, "forged")), ("bad", 42)):
        job = world.dispatched(entry_on(HOME, name))
        headers = {} if forged is None else {HEADER_KEY: forged}
        first = _deliver(world, world.worker(), job, **headers)
        again = _deliver(world, world.worker(), job, **headers)
        done = world.beat.get(job.ref)
        assert done is not None
        outcomes[name] = [first, again, done.state, done.attempt, [h.reason for h in done.history]]
    assert outcomes["right"][:3] == ["ran", "ignored", State.SUCCEEDED]
    assert outcomes["wrong"] == outcomes["right"] and outcomes["bad"] == outcomes["right"]
    assert len(world.runs) == 3
