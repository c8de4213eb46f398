"""The atomic enqueue: a broker on the store's own Redis server gets the record and its message
in one script (``Dispatcher.enqueue``).

On a private redis-server (store in database 1, broker in database 2): what
the script pushes is byte for byte what kombu publishes (but kombu's random
delivery tag), a push Redis refuses writes nothing, an existing job is not
pushed again, a lost answer is settled by reading back, and every broker the
capture cannot reproduce gets the record written alone by one script, then
the publish.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Exchange, Queue

from celery_exactonce.core import exceptions, jobs
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.dispatch import messages
from celery_exactonce.dispatch.dispatcher import Dispatcher
from celery_exactonce.dispatch.messages import GATED_OPTION
from celery_exactonce.dispatch.one_step import ENQUEUED
from celery_exactonce.dispatch.publisher import CeleryPublisher
from celery_exactonce.stores.redis.store import Push, PushRefused, RedisStore
from tests.integration.redis_server import RedisServer, redis_server

NAMESPACE = "enq"


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


def _url(server: RedisServer, db: int, user: str = "") -> str:
    auth = f"{user}:secret@" if user else ""
    return f"redis://{auth}127.0.0.1:{server.port}/{db}"


def _app(broker: str, **conf: Any) -> Celery:
    app = Celery("enq", broker=broker, set_as_current=False)
    app.conf.update(task_default_queue="enq", broker_connection_retry=False, **conf)
    return app


def _store(server: RedisServer, user: str = "") -> RedisStore:
    return RedisStore.from_url(_url(server, 1, user), namespace=NAMESPACE, retention=3600)


DEADLINE = datetime(2100, 1, 1, tzinfo=timezone.utc)


def _new(job_id: str = "j1", **options: Any) -> NewJob:
    return NewJob(
        JobRef.submitted(job_id),
        "t.add",
        State.SCHEDULED,
        node="n",
        args=[1, 2],
        kwargs={"k": "v"},
        options={GATED_OPTION: True, **options},
        reason="apply_async",
        deadline=DEADLINE,  # the message's expires
    )


def _dispatched(new: NewJob) -> Job:
    """The record an enqueue of ``new`` writes (times aside)."""
    now = datetime.now(timezone.utc)
    request = Transition(State.DISPATCHED, frozenset({State.SCHEDULED}), node="n", reason="x")
    return jobs.apply_transition(jobs.job_from_new(new, now), request, now)


def _broker_keys(server: RedisServer) -> dict[str, list[dict[str, Any]]]:
    """Every list of the broker's database, emptied: its messages, decoded.

    But kombu's random delivery tag, the TTL (checked) that counts down, and
    Sentry's publish time.
    """
    client = redis.Redis.from_url(_url(server, 2))
    out = {}
    for key in client.keys("*"):
        if client.type(key) != b"list":
            continue
        messages_ = [json.loads(raw) for raw in client.lrange(key, 0, -1)]
        for message in messages_:
            message["properties"].pop("delivery_tag")
            # The TTL left until the job's deadline, in ms, as of when the message was built.
            ttl = int(message["properties"].pop("expiration"))
            # A time Sentry's Celery integration stamps on each publish (when a test set it up).
            for headers in (message["headers"], message["headers"].get("headers") or {}):
                headers.pop("sentry-task-enqueued-time", None)
            left = (DEADLINE - datetime.now(timezone.utc)).total_seconds() * 1000
            assert abs(left - ttl) < 60_000
        out[key.decode()] = messages_
    client.flushdb()
    return out


CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # name: (app settings, job options)
    "default": ({}, {}),
    "priority": ({}, {"priority": 7}),
    "queue": ({}, {"queue": "other"}),
    "headers": ({}, {"headers": {"tenant": "a"}, "shadow": "s", "time_limit": 30}),
    "link": (
        {},
        {
            "link": [
                {
                    "task": "t.cb",
                    "args": [],
                    "kwargs": {},
                    "options": {},
                    "subtask_type": None,
                    "immutable": False,
                }
            ]
        },
    ),
    "routed-topic": (
        {
            "task_queues": [Queue("topical", Exchange("tx", type="topic"), routing_key="t.#")],
            "task_routes": {"t.add": {"queue": "topical", "routing_key": "t.add"}},
        },
        {},
    ),
    "global-keyprefix": ({"broker_transport_options": {"global_keyprefix": "pfx:"}}, {}),
    "queue-expires": (
        {"task_queues": [Queue("short", queue_arguments={"x-expires": 60_000})]},
        {"queue": "short"},
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_message_pushed_is_the_message_kombu_publishes(server: RedisServer, case: str) -> None:
    conf, options = CASES[case]
    store = _store(server)
    job = _dispatched(_new(**options))
    headers = messages.message_headers(job, NAMESPACE)
    publisher = CeleryPublisher(_app(_url(server, 2), **conf))
    publisher(job, headers, {})
    published = _broker_keys(server)
    assert published, "kombu published nothing"

    captured = publisher.capture(job, headers, {}, store.shares_server)
    assert captured is not None
    assert _broker_keys(server) == {}  # capturing sends nothing
    assert captured.sent.id == job.ref.id
    new = _new(**options)
    request = Transition(
        State.DISPATCHED, frozenset({State.SCHEDULED}), node="n", reason="x", rev=new.rev
    )
    assert store.enqueue(new, request, Push(captured.db, captured.commands)).created
    pushed = _broker_keys(server)
    assert pushed == published, _differences(pushed, published)


def _differences(left: Any, right: Any, path: str = "") -> list[str]:
    """Where two decoded messages differ, for the assertion message."""
    if isinstance(left, dict) and isinstance(right, dict):
        return [
            d
            for k in sorted(set(left) | set(right), key=str)
            for d in _differences(left.get(k), right.get(k), f"{path}.{k}")
        ]
    if isinstance(left, list) and isinstance(right, list) and len(left) == len(right):
        return [
            d
            for i, (a, b) in enumerate(zip(left, right, strict=True))
            for d in _differences(a, b, f"{path}[{i}]")
        ]
    return [] if left == right else [f"{path}: {left!r} != {right!r}"]


def _dispatcher(server: RedisServer, store: RedisStore, broker: str | None = None) -> Dispatcher:
    publisher = CeleryPublisher(_app(broker or _url(server, 2)))
    return Dispatcher(store, publisher, node="n")


def _queued(server: RedisServer) -> int:
    return int(redis.Redis.from_url(_url(server, 2)).llen("enq"))


def test_a_job_is_written_dispatched_with_its_message_in_one_step(server: RedisServer) -> None:
    store = _store(server)
    enqueued = _dispatcher(server, store).enqueue(_new(), reason="apply_async")
    assert enqueued is not None and enqueued.created
    record = store.get(JobRef.submitted("j1"))
    assert record is not None and record.state is State.DISPATCHED and record.dispatches == 1
    assert [(h.src, h.dst) for h in record.history] == [
        (None, State.SCHEDULED),
        (State.SCHEDULED, State.DISPATCHED),
    ]
    assert record.history[-1].reason == f"apply_async {ENQUEUED}"
    assert record.rev == record.history[-1].rev
    assert _queued(server) == 1
    # ... and the DISPATCHED index names it, so the reconciler finds it when it stalls
    # (fails before the fix: a field written before the record's ref took its place)
    assert store.count_by_state()[State.DISPATCHED] == 1
    members = store._client.zrange(store._state_key(State.DISPATCHED), 0, -1)
    assert [m.decode() if isinstance(m, bytes) else m for m in members] == [str(record.ref)]


def test_an_existing_job_is_returned_and_nothing_is_pushed_again(server: RedisServer) -> None:
    store = _store(server)
    dispatcher = _dispatcher(server, store)
    first = dispatcher.enqueue(_new())
    again = dispatcher.enqueue(_new())
    assert first is not None and first.created
    assert again is not None and not again.created and again.job.rev == first.job.rev
    assert _queued(server) == 1


def _written_alone(store: RedisStore, job_id: str = "j1") -> Job:
    """The record of a submit written ``DISPATCHED`` by one script, without its message."""
    record = store.get(JobRef.submitted(job_id))
    assert record is not None and record.dispatches == 1
    created, dispatched = record.history[:2]
    assert (created.dst, dispatched.dst, created.at) == (
        State.SCHEDULED,
        State.DISPATCHED,
        dispatched.at,
    )
    assert ENQUEUED not in dispatched.reason  # nothing proves the message left
    return record


def test_a_push_redis_refuses_writes_nothing(server: RedisServer) -> None:
    admin = redis.Redis.from_url(_url(server, 0))
    admin.execute_command(
        "ACL", "SETUSER", "nolpush", "on", ">secret", "~*", "&*", "+@all", "-lpush"
    )
    store = _store(server, user="nolpush")
    dispatcher = _dispatcher(server, store)
    one_step = dispatcher._one_step
    assert one_step.enqueue(_new()) is None  # the one-step submit declines
    assert store.get(JobRef.submitted("j1")) is None
    assert _queued(server) == 0
    assert one_step.enqueue(_new("j2")) is None  # not tried again by this process
    assert store.get(JobRef.submitted("j2")) is None
    # The dispatcher then writes the record alone, and publishes through the broker connection
    enqueued = dispatcher.enqueue(_new("j3"))
    assert enqueued is not None and enqueued.created and enqueued.sent is not None
    assert _written_alone(store, "j3").state is State.DISPATCHED
    assert _queued(server) == 1


def test_a_push_refused_midway_is_undone_and_writes_nothing(server: RedisServer) -> None:
    """The message pushed, then a later command refused: the push is taken back."""
    admin = redis.Redis.from_url(_url(server, 0))
    admin.execute_command(
        "ACL", "SETUSER", "nopublish", "on", ">secret", "~*", "&*", "+@all", "-publish"
    )
    store = _store(server, user="nopublish")
    new = _new()
    request = Transition(
        State.DISPATCHED, frozenset({State.SCHEDULED}), node="n", reason="x", rev=new.rev
    )
    push = Push(2, (("lpush", "enq", "m1"), ("publish", "fanout", "m2")))
    with pytest.raises(PushRefused):
        store.enqueue(new, request, push)
    assert store.get(new.ref) is None
    assert _queued(server) == 0


def test_keys_redis_refuses_write_nothing(server: RedisServer) -> None:
    """A user that may not touch the broker's keys: the script does not run; nothing written."""
    admin = redis.Redis.from_url(_url(server, 0))
    admin.execute_command(
        "ACL", "SETUSER", "storeonly", "on", ">secret", "&*", "+@all", "~exactonce:*"
    )
    store = _store(server, user="storeonly")
    dispatcher = _dispatcher(server, store)
    assert dispatcher._one_step.enqueue(_new()) is None
    assert store.get(JobRef.submitted("j1")) is None
    assert _queued(server) == 0
    # The record alone is within the user's keys: written, then published by kombu
    enqueued = dispatcher.enqueue(_new())
    assert enqueued is not None and enqueued.created and enqueued.sent is not None
    assert _written_alone(store).state is State.DISPATCHED
    assert _queued(server) == 1


class LoseAnswer(RedisStore):
    """Runs the enqueue script (or not), then fails as a connection lost mid-call would."""

    apply = True
    #: A worker's gate takes the job before the writer reads it back.
    taken = False

    def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        if name == "enqueue":
            if self.apply:
                super()._run(name, keys, args)
            if self.taken:
                gate = Transition(
                    State.RUNNING,
                    frozenset({State.DISPATCHED}),
                    node="w",
                    reason="gate",
                    new_run_id="r1",
                )
                assert self.transition(JobRef.submitted("j1"), gate).applied
            raise redis.ConnectionError("connection lost")
        return super()._run(name, keys, args)


@pytest.mark.parametrize("outcome", ["applied", "applied-then-taken", "not-applied"])
def test_a_lost_answer_is_settled_by_reading_back(server: RedisServer, outcome: str) -> None:
    store = LoseAnswer.from_url(_url(server, 1), namespace=NAMESPACE, retention=3600)
    store.apply = outcome != "not-applied"
    store.taken = outcome == "applied-then-taken"
    dispatcher = _dispatcher(server, store)
    if outcome == "not-applied":
        with pytest.raises(exceptions.StoreError):  # unknown: the caller says SubmitAmbiguous
            dispatcher.enqueue(_new())
        assert _queued(server) == 0
        return
    enqueued = dispatcher.enqueue(_new())
    # Ours (not a resubmission), even when a gate moved the job on before the read back
    assert enqueued is not None and enqueued.created and enqueued.sent is not None
    assert enqueued.job.state is (State.RUNNING if store.taken else State.DISPATCHED)
    assert _queued(server) == 1


@pytest.mark.parametrize(
    "broker",
    ["amqp://guest:guest@127.0.0.1:1//", "redis://localhost:{port}/2", "redis://127.0.0.1:1/2"],
    ids=["another-transport", "another-host-name", "another-server"],
)
def test_a_broker_the_capture_cannot_reach_takes_the_general_path(
    server: RedisServer, broker: str
) -> None:
    store = _store(server)
    dispatcher = _dispatcher(server, store, broker.format(port=server.port))
    assert dispatcher._one_step.enqueue(_new()) is None
    assert store.get(JobRef.submitted("j1")) is None
    # The dispatcher writes the record alone, then publishes through the broker connection:
    # a broker that refuses the connection rolls it back (nothing can have been sent)
    enqueued = dispatcher.enqueue(_new())
    assert enqueued is not None and enqueued.created
    reachable = broker.startswith("redis://localhost")
    assert (enqueued.sent is not None) is reachable
    record = _written_alone(store)
    assert record.state is (State.DISPATCHED if reachable else State.SCHEDULED)
    assert _queued(server) == (1 if reachable else 0)


def test_a_broker_elsewhere_costs_one_store_call_before_the_publish(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record written ``DISPATCHED`` by one script, the only store call of the submit
    (the message built while its answer is on the way), then the publish; no ``PUBLISHED``
    write after the publish of a gated job."""
    store = _store(server)
    dispatcher = _dispatcher(server, store, f"redis://localhost:{server.port}/2")
    assert dispatcher.enqueue(_new("j0")) is not None  # loads the script on the fresh server
    sent: list[tuple[int, str]] = []  # (database, command), in the order they were sent
    send = redis.connection.AbstractConnection.send_packed_command

    def counted(self: Any, command: Any, check_health: bool = True) -> Any:
        packed = b"".join(command) if isinstance(command, list) else command
        sent.append((int(self.db), packed.split(b"\r\n")[2].decode().upper()))
        return send(self, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted)
    for job_id in ("j1", "j2"):
        enqueued = dispatcher.enqueue(_new(job_id))
        assert enqueued is not None and enqueued.created and enqueued.sent is not None
    monkeypatch.undo()
    assert [name for db, name in sent if db == 1] == ["EVALSHA", "EVALSHA"]
    # Each message pushed after its record's script was sent
    pushes = [i for i, (db, name) in enumerate(sent) if db == 2 and name == "LPUSH"]
    scripts = [i for i, (db, _) in enumerate(sent) if db == 1]
    assert len(pushes) == 2 and scripts[0] < pushes[0] < scripts[1] < pushes[1], sent
    assert _written_alone(store, "j2").state is State.DISPATCHED
    assert _queued(server) == 3


@pytest.mark.parametrize("flushed", [False, True], ids=["loaded", "script-flushed"])
def test_the_record_alone_runs_meanwhile_once_and_a_lost_script_is_loaded(
    server: RedisServer, flushed: bool
) -> None:
    """``enqueue`` without a push, with ``meanwhile``: the caller's work runs once; a server
    that lost the script (restarted, flushed) loads it and runs the call again, the work
    not repeated."""
    store = _store(server)
    store.ping()
    admin = redis.Redis.from_url(_url(server, 0))
    if flushed:
        admin.script_flush()
    new = _new()
    request = Transition(
        State.DISPATCHED, frozenset({State.SCHEDULED}), node="n", reason="x", rev=new.rev
    )
    ran: list[str] = []
    assert store.enqueue(new, request, meanwhile=lambda: ran.append("first")).created
    assert ran == ["first"]
    record = store.get(new.ref)
    assert record is not None and record.state is State.DISPATCHED
    assert record.rev == request.new_rev
    again = store.enqueue(new, request, meanwhile=lambda: ran.append("again"))
    assert not again.created and ran == ["first", "again"]  # the work runs, the record stands
    assert again.job is not None and again.job.rev == record.rev


def test_one_capturing_connection_serves_calls_one_after_another(server: RedisServer) -> None:
    store = _store(server)
    publisher = CeleryPublisher(_app(_url(server, 2)))
    dispatcher = Dispatcher(store, publisher, node="n")
    for i in range(5):
        enqueued = dispatcher.enqueue(_new(f"j{i}"))
        assert enqueued is not None and enqueued.created
    assert len(publisher._captures) == 1
    assert _queued(server) == 5


def _subscribed(server: RedisServer, topic: str) -> Any:
    """A subscriber of ``topic`` (a fanout's channel), its subscription confirmed."""
    pubsub = redis.Redis.from_url(_url(server, 0)).pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(topic)
    assert pubsub.get_message(timeout=5.0) is None  # the confirmation, skipped
    return pubsub


def _published(pubsub: Any) -> list[bytes]:
    """What the subscriber received within half a second (a PUBLISH arrives at once)."""
    received = []
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        message = pubsub.get_message(timeout=0.1)
        if message is not None:
            received.append(message["data"])
    return received


def test_a_fanout_publish_is_never_sent_before_a_command_that_fails(server: RedisServer) -> None:
    """A PUBLISH cannot be taken back: the script runs it after every command that can fail.

    Before the fix, the script ran the broker commands in the order given: a
    ``publish`` before an ``lpush`` Redis refused reached the fanout's
    subscribers, and the script then answered ``push_failed`` with no record.
    """
    admin = redis.Redis.from_url(_url(server, 0))
    admin.execute_command(
        "ACL", "SETUSER", "nolpush", "on", ">secret", "~*", "&*", "+@all", "-lpush"
    )
    store = _store(server, user="nolpush")
    subscriber = _subscribed(server, "/2.fanout")
    new = _new()
    request = Transition(
        State.DISPATCHED, frozenset({State.SCHEDULED}), node="n", reason="x", rev=new.rev
    )
    push = Push(2, (("publish", "/2.fanout", "m1"), ("lpush", "enq", "m2")))
    with pytest.raises(PushRefused):
        store.enqueue(new, request, push)
    assert _published(subscriber) == []
    assert store.get(new.ref) is None
    assert _queued(server) == 0


def test_a_fanout_publish_is_not_sent_when_the_record_cannot_be_written(
    server: RedisServer,
) -> None:
    """A server out of memory refuses the record: the fanout's message is not published.

    Before the fix, the ``PUBLISH`` (not a write: Redis lets it through out of
    memory) ran first; the record's ``HSET`` was then refused, and the message
    reached the subscribers of a job that does not exist.
    """
    store = _store(server)
    store.get(JobRef.submitted("warm"))  # connected, before the server is out of memory
    subscriber = _subscribed(server, "/2.fanout")
    admin = redis.Redis.from_url(_url(server, 0))
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)
    try:
        new = _new()
        request = Transition(
            State.DISPATCHED, frozenset({State.SCHEDULED}), node="n", reason="x", rev=new.rev
        )
        with pytest.raises(exceptions.StoreError):
            store.enqueue(new, request, Push(2, (("publish", "/2.fanout", "m1"),)))
        assert _published(subscriber) == []
    finally:
        admin.config_set("maxmemory", 0)
    assert store.get(new.ref) is None
