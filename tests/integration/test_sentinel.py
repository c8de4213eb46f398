"""Sentinel and ``exactonce_min_replicas`` on real servers: a master, replicas, sentinels.

Each test starts its own servers on free ports (tests/integration/redis_server.py),
with no persistence, and kills them by pid. A replica is paused with SIGSTOP
(its acknowledgements stop, its connection stays up), so that ``WAIT`` times out.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import pytest
from celery import Celery

from celery_exactonce import ConfigurationError, ExactOnceConfig, StoreUnavailable, open_store
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.dispatch.dispatcher import Dispatcher
from celery_exactonce.dispatch.outcomes import Outcome
from celery_exactonce.stores import settle
from celery_exactonce.stores.redis.base import NotReplicated
from tests.integration.redis_server import RedisServer, redis_server, sentinel_group, wait_for
from tests.support.helpers import occurrence

pytestmark = pytest.mark.timeout(120)


def _app(url: str, **settings: Any) -> Celery:
    app = Celery("sentinel-test", set_as_current=False)
    app.conf.exactonce_store_url = url
    app.conf.exactonce_store_timeout = 1.0
    for name, value in settings.items():
        app.conf[f"exactonce_{name}"] = value
    return app


def _config(url: str, **settings: Any) -> ExactOnceConfig:
    return ExactOnceConfig.from_app(_app(url, **settings))


@contextmanager
def master_with_replicas(count: int) -> Iterator[tuple[RedisServer, list[RedisServer]]]:
    """A master and ``count`` replicas online (no sentinel: these tests never fail over)."""
    with redis_server() as master:
        replicas: list[RedisServer] = []
        try:
            for _ in range(count):
                replica = RedisServer("--replicaof", "127.0.0.1", str(master.port))
                replicas.append(replica)
                replica.start()

            def online() -> bool:
                info = master.client(1.0).info("replication")
                states = [v.get("state") for k, v in info.items() if k.startswith("slave")]
                return states.count("online") >= count

            wait_for(f"{count} replicas online", online)
            yield master, replicas
        finally:
            for replica in replicas:
                replica.kill()


@contextmanager
def paused(server: RedisServer) -> Iterator[None]:
    """``server`` stopped (SIGSTOP): it acknowledges nothing until resumed."""
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


class Broker:
    """A publisher that records what it is given."""

    def __init__(self) -> None:
        self.sent: list[Job] = []

    def __call__(self, job: Job, headers: Mapping[str, Any], extra: Mapping[str, Any]) -> None:
        self.sent.append(job)


def _submitted(job_id: str) -> NewJob:
    return NewJob(JobRef.submitted(job_id), "tasks.t", State.SCHEDULED, node="n", args=[1])


def test_a_write_with_min_replicas_1_waits_for_a_replica_and_is_ambiguous_without_one() -> None:
    with master_with_replicas(1) as (master, (replica,)):
        store = open_store(_config(master.url, min_replicas=1))
        try:
            # Given a write the replica confirms: it counts
            first = store.create(_submitted("confirmed"))
            assert first.created
            # When the replica stops acknowledging
            with paused(replica):
                fire = store.now().replace(microsecond=0)
                claim = occurrence("nightly", fire)
                started = time.monotonic()
                with pytest.raises(NotReplicated) as caught:
                    store.create_many([claim], epoch=store.epoch())
                # Then the claim waited its store timeout and is not counted
                assert time.monotonic() - started >= 0.9
                assert isinstance(caught.value, StoreUnavailable)
                assert "exactonce_min_replicas" in str(caught.value)
                # and settling it reads back a record no replica confirms: unknown
                written = settle.create_many(store, [claim], tries=1)
                assert written[0].decision is settle.Decision.UNKNOWN
            # And a DISPATCHED write no replica confirms publishes nothing
            job = store.get(JobRef.submitted("confirmed"))
            assert job is not None and job.state is State.SCHEDULED
            broker = Broker()
            with paused(replica):
                result = Dispatcher(store, broker, node="n").dispatch(job, retry=False)
            assert result.outcome is Outcome.FAIL_CLOSED
            assert broker.sent == []
            # Once the replica is back, the same dispatch goes through, confirmed
            again = store.get(job.ref)
            assert again is not None
            if again.state is State.SCHEDULED:
                assert Dispatcher(store, broker, node="n").dispatch(again).outcome is (
                    Outcome.PUBLISHED
                )
                assert [j.ref for j in broker.sent] == [job.ref]
        finally:
            store.drop_namespace()
            store.close()


def test_min_replicas_0_never_waits_for_a_paused_replica() -> None:
    with master_with_replicas(1) as (master, (replica,)):
        store = open_store(_config(master.url))
        try:
            with paused(replica):
                started = time.monotonic()
                assert store.create(_submitted("fast")).created
                assert store.get(JobRef.submitted("fast")) is not None
                assert time.monotonic() - started < 0.5
        finally:
            store.drop_namespace()
            store.close()


def test_min_replicas_2_with_one_replica_is_refused_at_start_up() -> None:
    from celery_exactonce import startup
    from celery_exactonce.cli.check import run_checks

    with master_with_replicas(1) as (master, _):
        app = _app(master.url, min_replicas=2)
        with pytest.raises(ConfigurationError) as caught:
            startup.check_beat(app)
        assert caught.value.setting == "exactonce_min_replicas"
        assert "1 connected replica" in str(caught.value)
        report = run_checks(app)
        failed = [c for c in report.checks if c.status == "FAIL"]
        assert [c.name for c in failed] == ["replicas"]
        assert failed[0].setting == "exactonce_min_replicas"
        # one replica is enough for min_replicas=1
        store = open_store(_config(master.url, min_replicas=1))
        store.close()


def test_a_sentinel_store_reaches_the_new_master_after_a_failover() -> None:
    with sentinel_group(replicas=2, sentinels=3) as group:
        url = group.url(db=3)
        store = open_store(_config(url, min_replicas=1))
        try:
            assert store.create(_submitted("before")).created  # confirmed on a replica
            old = group.current_master()
            # When the master is SIGKILLed and the sentinels promote a replica
            new = group.failover_after_kill()
            assert new.port != old.port

            # Then the same store reaches the new master, the confirmed write on it
            def reached() -> bool:
                try:
                    return store.get(JobRef.submitted("before")) is not None
                except StoreUnavailable:
                    return False

            wait_for("the store on the new master", reached, timeout=60)
            group.wait_replicas(1)
            assert store.create(_submitted("after")).created
            # the records are on the promoted replica, in the URL's database
            keys = new.client(db=3).keys(f"exactonce:{{{store.namespace}}}:job:*")
            assert len(keys) == 2
        finally:
            store.close()
