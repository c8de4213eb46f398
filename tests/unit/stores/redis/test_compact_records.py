"""Redis: a compacted terminal record is a small listpack, and the records of earlier versions
are still read and purged (on the shared Redis: encodings are the server's own)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import redis

from celery_exactonce.core.jobs import Compaction
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.stores.redis.store import RedisStore
from tests import services
from tests.support.backends import StoreFactory
from tests.support.helpers import move, poll

COMPACT = Compaction(history="none", payload=False)


@pytest.fixture
def factory() -> Iterator[StoreFactory]:
    services.need("redis")
    made = StoreFactory("redis")
    yield made
    made.cleanup()


def _client(store: RedisStore) -> redis.Redis:
    return store._client


def _beat_job(entry: str, store: RedisStore) -> NewJob:
    # A 64-character id, as beat's occurrences have: its ref alone is too long for a listpack
    return NewJob(
        JobRef.occurrence("a" * 60 + entry),
        "tasks.tick",
        State.SCHEDULED,
        node="bench-host-01:12345",
        args=[1, {"k": "v" * 80}],
        options={"exactonce_gated": False, "reply_to": "x" * 40},
        entry=entry,
        fire_time=store.now() - timedelta(seconds=1),
        reason="beat claim",
    )


def _published(store: RedisStore, new: NewJob) -> None:
    created = store.create(new).job
    assert created is not None
    move(store, move(store, created, State.DISPATCHED), State.PUBLISHED)


def test_a_compacted_terminal_record_is_a_small_listpack(factory: StoreFactory) -> None:
    store = factory(compaction=COMPACT)
    assert isinstance(store, RedisStore)
    new = _beat_job("e001", store)
    _published(store, new)
    key = store._job_key(new.ref)
    client = _client(store)
    assert client.object("encoding", key) in (b"listpack", b"ziplist")
    fields = {f.decode() if isinstance(f, bytes) else f for f in client.hkeys(key)}
    assert not fields & {"ref", "history", "args", "kwargs", "options"}, fields
    assert int(client.memory_usage(key, samples=0)) < 600
    # And it costs no member of the expiry index: its state's index finds it
    assert client.zscore(store._expire_key, str(new.ref)) is None
    assert client.zscore(store._state_key(State.PUBLISHED), str(new.ref)) is not None


def test_with_every_default_a_terminal_record_keeps_everything(factory: StoreFactory) -> None:
    store = factory()
    assert isinstance(store, RedisStore)
    new = _beat_job("e002", store)
    _published(store, new)
    got = store.get(new.ref)
    assert got is not None and len(got.history) == 3 and got.args == new.args
    assert _client(store).hget(store._job_key(new.ref), "ref") is not None


def test_a_record_of_an_earlier_version_is_read_and_purged(factory: StoreFactory) -> None:
    # Given a terminal record as earlier versions left it: every field, and a member of
    # the expiry index as well as of its state's (what their transition script wrote)
    store = factory(retention=0.2, compaction=COMPACT)
    assert isinstance(store, RedisStore)
    new = _beat_job("e003", store)
    created = store.create(new).job
    assert created is not None
    done = move(store, created, State.DISPATCHED)
    client = _client(store)
    key = store._job_key(new.ref)
    client.hset(key, mapping={"state": "PUBLISHED", "terminal_at": client.hget(key, "touched_at")})
    client.zrem(store._state_key(State.DISPATCHED), str(new.ref))
    touched = int(client.hget(key, "touched_at"))
    client.zadd(store._state_key(State.PUBLISHED), {str(new.ref): touched})
    client.zadd(store._expire_key, {str(new.ref): touched + 200_000})
    # When this version reads it, it is the record it was, its history and payload whole
    old = store.get(new.ref)
    assert old is not None and old.state is State.PUBLISHED and old.ref == new.ref
    assert old.args == new.args and [h.dst for h in old.history] == [
        State.SCHEDULED,
        State.DISPATCHED,
    ]
    assert old.rev == done.rev
    assert [j.ref for j in store.list_stale(State.PUBLISHED, 0, 10)] == [new.ref]
    # And once past its retention it is purged once, from both indexes
    end = old.touched_at + timedelta(seconds=0.25)
    poll(lambda: store.now() >= end)
    assert store.purge_expired(10) == 1
    assert store.purge_expired(10) == 0
    assert store.get(new.ref) is None
    assert client.zcard(store._expire_key) == 0
    assert client.zcard(store._state_key(State.PUBLISHED)) == 0
