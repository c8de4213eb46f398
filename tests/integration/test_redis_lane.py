"""The connection each thread keeps for the Redis store's script calls (``client.Lane``).

On a server of the test's own, so that its connection counts are the store's alone.
"""

from __future__ import annotations

import gc
import multiprocessing
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.backoff
import redis.retry
import redis.sentinel

from celery_exactonce.core import exceptions
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.stores.redis.client import Lane
from celery_exactonce.stores.redis.store import RedisStore
from tests.integration.redis_server import RedisServer, redis_server
from tests.support.helpers import poll

NAMESPACE = "lane"


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


@pytest.fixture
def store(server: RedisServer) -> Iterator[RedisStore]:
    store = RedisStore.from_url(
        f"redis://127.0.0.1:{server.port}/1", namespace=NAMESPACE, retention=3600
    )
    try:
        yield store
    finally:
        store.close()


def _new(job_id: str) -> NewJob:
    return NewJob(JobRef.submitted(job_id), "t.add", State.SCHEDULED, node="n", args=[1])


def _pool(store: RedisStore) -> Any:
    return store._client.connection_pool


def _connections(admin: redis.Redis) -> int:
    """Connections the server accepted so far (``admin``'s one among them)."""
    return int(admin.info("stats")["total_connections_received"])


def test_one_connection_serves_every_script_call_of_a_thread(
    server: RedisServer, store: RedisStore
) -> None:
    assert store._lane is not None
    store.create(_new("j0"))
    admin = server.client()
    before = _connections(admin)
    for i in range(1, 21):
        assert store.create(_new(f"j{i}")).created
    assert _connections(admin) == before
    assert len(_pool(store)._in_use_connections) == 1  # kept by this thread


def test_a_thread_that_ends_gives_its_connection_back(store: RedisStore) -> None:
    pool = _pool(store)
    kept: list[Any] = []
    worker = threading.Thread(target=lambda: kept.append(store.create(_new("j1"))))
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive() and kept[0].created

    def given_back() -> bool:
        gc.collect()
        return not pool._in_use_connections

    poll(given_back, timeout=10)  # the ended thread's connection is back in the pool
    created = pool._created_connections
    assert store.create(_new("j2")).created  # this thread takes one of those given back
    assert pool._created_connections == created


def test_a_connection_the_server_closed_is_connected_again_before_the_next_call(
    server: RedisServer, store: RedisStore
) -> None:
    """As the pool checks a connection it hands out: a server restart, or a client
    killed while idle, costs the next call nothing."""
    assert store.create(_new("j1")).created
    kept = store._lane._local.kept  # type: ignore[union-attr]
    server.client().client_kill_filter(_type="normal", skipme=True)  # the store's connection
    assert store.create(_new("j2")).created
    assert store._lane._local.kept is kept  # type: ignore[union-attr]
    assert len(_pool(store)._in_use_connections) == 1


def test_a_connection_lost_under_a_call_is_dropped_and_the_next_call_reconnects(
    server: RedisServer, store: RedisStore
) -> None:
    new = _new("j1")
    request = Transition(
        State.DISPATCHED, frozenset({State.SCHEDULED}), node="n", reason="x", rev=new.rev
    )
    assert store.create(_new("j0")).created
    conn = store._lane._local.kept.conn  # type: ignore[union-attr]

    def gone(*args: Any, **kwargs: Any) -> Any:
        del conn.read_response  # (once)
        raise redis.ConnectionError("connection lost")

    def lost() -> None:  # while the script's answer is on the way, the link goes
        conn.read_response = gone

    with pytest.raises(exceptions.StoreError):  # its answer lost: the outcome is unknown
        store.enqueue(new, request, meanwhile=lost)
    pool = _pool(store)
    assert not pool._in_use_connections  # disconnected and given back
    assert store.create(_new("j3")).created
    assert store.get(JobRef.submitted("j3")) is not None
    assert len(pool._in_use_connections) == 1


def test_an_error_answer_keeps_the_connection(server: RedisServer, store: RedisStore) -> None:
    assert store.create(_new("j1")).created
    kept = store._lane._local.kept.conn  # type: ignore[union-attr]
    server.client().script_flush()  # the next call is answered NOSCRIPT, loads it, runs again
    assert store.create(_new("j2")).created
    assert store._lane._local.kept.conn is kept  # type: ignore[union-attr]
    assert kept._sock is not None  # never disconnected


def test_work_meanwhile_that_raises_drops_the_connection_with_its_answer_unread(
    store: RedisStore,
) -> None:
    new = _new("j1")
    request = Transition(
        State.DISPATCHED, frozenset({State.SCHEDULED}), node="n", reason="x", rev=new.rev
    )

    def fails() -> None:
        raise RuntimeError("meanwhile failed")

    with pytest.raises(RuntimeError):  # the script's outcome is unknown
        store.enqueue(new, request, meanwhile=fails)
    assert not _pool(store)._in_use_connections
    # The next call reads its own answer, not the one left unread: created now, or the
    # record the first call wrote
    again = store.enqueue(new, request, meanwhile=lambda: None)
    record = store.get(new.ref)
    assert record is not None and record.state is State.DISPATCHED
    assert record.rev == request.new_rev
    assert again.created or (again.job is not None and again.job.rev == request.new_rev)
    assert len(_pool(store)._in_use_connections) == 1


def _create_in_child(store: RedisStore, job_id: str, answers: Any) -> None:
    answers.put(store.create(_new(job_id)).created)


def test_a_forked_child_takes_a_connection_of_its_own(
    server: RedisServer, store: RedisStore
) -> None:
    assert store.create(_new("j1")).created
    admin = server.client()
    before = _connections(admin)
    fork = multiprocessing.get_context("fork")
    answers = fork.Queue()
    child = fork.Process(target=_create_in_child, args=(store, "j2", answers))
    child.start()
    child.join(timeout=30)
    assert child.exitcode == 0
    assert answers.get(timeout=5) is True
    assert _connections(admin) - before == 1  # the child's
    # The parent's connection is its own still: its next answer is its own
    assert store.create(_new("j3")).created
    assert not store.create(_new("j2")).created  # the child's create is there


def test_only_a_plain_client_on_its_own_pool_with_real_threads_keeps_connections(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"redis://127.0.0.1:{server.port}/1"
    assert Lane.suits(redis.Redis.from_url(url))
    assert not Lane.suits(redis.Redis.from_url(url, single_connection_client=True))
    retrying = redis.Redis.from_url(
        url, retry=redis.retry.Retry(redis.backoff.NoBackoff(), retries=3)
    )
    assert not Lane.suits(retrying)
    sentinel = redis.sentinel.Sentinel([("127.0.0.1", server.port)])
    assert not Lane.suits(sentinel.master_for("mymaster"))
    monkeypatch.setattr(threading, "local", type("GreenLocal", (), {}))
    assert not Lane.suits(redis.Redis.from_url(url))
