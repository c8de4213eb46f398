"""RedisStore at its boundary: driver errors wrapped, bad config refused (no server needed)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import fakeredis
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_exactonce.core import exceptions
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.stores.base import StateStore
from celery_exactonce.stores.redis.store import RedisStore

PASSWORD = "s3cret-pw"


@pytest.fixture
def client() -> Iterator[fakeredis.FakeRedis]:
    server = fakeredis.FakeServer()
    fake = fakeredis.FakeRedis(server=server, password=PASSWORD)
    yield fake
    fake.close()


@pytest.fixture
def store(client: fakeredis.FakeRedis) -> RedisStore:
    return RedisStore(client, namespace="faults", retention=60.0)


def _new(job_id: str = "j1") -> NewJob:
    return NewJob(JobRef.submitted(job_id), "tasks.add", State.SCHEDULED, node="n", args=(1,))


def test_fits_the_protocol(store: RedisStore) -> None:
    typed: StateStore = store
    assert isinstance(typed, StateStore)


def test_works_end_to_end_on_fakeredis(store: RedisStore) -> None:
    # The scripts run (fakeredis[lua]): a smoke check that the wrapping leaves results alone
    store.setup()
    epoch = store.epoch()
    new = _new()
    assert store.create(new, epoch=epoch).created
    result = store.transition(
        new.ref, Transition(State.DISPATCHED, frozenset({State.SCHEDULED}), node="n", reason="d")
    )
    assert result.applied and result.job is not None and result.job.dispatches == 1
    assert store.get(new.ref) == result.job


def test_refused_connection_is_unavailable_without_the_password() -> None:
    # Nothing listens on port 1: the connection is refused before any byte is sent
    store = RedisStore.from_url(
        f"redis://:{PASSWORD}@127.0.0.1:1/0",
        namespace="faults",
        retention=60.0,
        socket_timeout=0.5,
    )
    try:
        with pytest.raises(exceptions.StoreUnavailable) as info:
            store.now()
        assert isinstance(info.value.__cause__, redis.ConnectionError)
        assert PASSWORD not in str(info.value)
        assert "***" in str(info.value)
    finally:
        store.close()


def test_refused_connection_on_a_given_client_hides_its_password() -> None:
    client = redis.Redis(
        host="127.0.0.1",
        port=1,
        password=PASSWORD,
        socket_connect_timeout=0.5,
        retry=Retry(NoBackoff(), 0),
    )
    store = RedisStore(client, namespace="faults", retention=60.0)
    with pytest.raises(exceptions.StoreUnavailable) as info:
        store.create(_new())
    assert isinstance(info.value.__cause__, redis.ConnectionError)
    assert PASSWORD not in str(info.value)
    client.close()


def test_disconnected_server_is_unavailable(client: fakeredis.FakeRedis, store: RedisStore) -> None:
    client.connection_pool.connection_kwargs["server"].connected = False
    with pytest.raises(exceptions.StoreUnavailable) as info:
        store.get(JobRef.submitted("j1"))
    assert isinstance(info.value.__cause__, redis.ConnectionError)


@pytest.mark.parametrize(
    "error",
    [
        redis.TimeoutError("Timeout reading from socket"),
        redis.exceptions.BusyLoadingError("Redis is loading the dataset in memory"),
        redis.exceptions.TryAgainError("TRYAGAIN"),
        redis.exceptions.ReadOnlyError("You can't write against a read only replica."),
        redis.ResponseError("BUSY Redis is busy running a script."),
    ],
)
def test_transient_errors_are_unavailable(
    client: fakeredis.FakeRedis,
    store: RedisStore,
    monkeypatch: pytest.MonkeyPatch,
    error: redis.RedisError,
) -> None:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise error

    monkeypatch.setattr(client, "time", fail)
    with pytest.raises(exceptions.StoreUnavailable) as info:
        store.now()
    assert info.value.__cause__ is error


def test_response_error_is_a_store_error(client: fakeredis.FakeRedis, store: RedisStore) -> None:
    # A foreign value where a record should be: Redis answers WRONGTYPE
    client.set("exactonce:{faults}:job:t:j1", "not a hash")
    for call in (
        lambda: store.get(JobRef.submitted("j1")),
        lambda: store.transition(
            JobRef.submitted("j1"),
            Transition(State.CANCELLED, frozenset({State.SCHEDULED}), node="n", reason="x"),
        ),
    ):
        with pytest.raises(exceptions.StoreError) as info:
            call()
        assert not isinstance(info.value, exceptions.StoreUnavailable)
        assert isinstance(info.value.__cause__, redis.ResponseError)
        assert PASSWORD not in str(info.value)


def test_closed_store_refuses_use(store: RedisStore) -> None:
    store.close()
    with pytest.raises(exceptions.StoreError, match="closed"):
        store.get(JobRef.submitted("j1"))


def test_newer_key_format_is_refused(client: fakeredis.FakeRedis, store: RedisStore) -> None:
    client.hset("exactonce:{faults}:meta", "format_version", "999")
    with pytest.raises(exceptions.SchemaMismatch, match="999"):
        store.setup()


@pytest.mark.parametrize("prefix", ["", "a:b", "x{y}", "sp ace", "p" * 65])
def test_bad_key_prefix_is_refused(client: fakeredis.FakeRedis, prefix: str) -> None:
    with pytest.raises(exceptions.ConfigurationError) as info:
        RedisStore(client, namespace="faults", retention=60.0, prefix=prefix)
    assert info.value.setting == "exactonce_key_prefix"


def test_keys_share_one_cluster_slot(client: fakeredis.FakeRedis, store: RedisStore) -> None:
    store.create(_new("a:b{c}"))
    store.acquire_lease("recon", "tok", 30)
    store.epoch()
    keys = [k.decode() for k in client.scan_iter()]
    assert keys and all(k.startswith("exactonce:{faults}:") for k in keys)
    store.drop_namespace()
    assert list(client.scan_iter()) == []


# -- check_config ------------------------------------------------------------------------


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise redis.ResponseError("unknown command 'CONFIG'")


def test_check_config_refuses_an_evicting_redis(
    client: fakeredis.FakeRedis, store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client, "config_get", lambda *a, **k: {"maxmemory-policy": "allkeys-lru"})
    with pytest.raises(exceptions.ConfigurationError, match="allkeys-lru") as info:
        store.check_config()
    assert info.value.setting == "exactonce_store_url"


def test_check_config_accepts_noeviction(
    client: fakeredis.FakeRedis, store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client, "config_get", lambda *a, **k: {b"maxmemory-policy": b"noeviction"})
    store.check_config()


def test_check_config_falls_back_to_info(
    client: fakeredis.FakeRedis, store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client, "config_get", _refuse)
    monkeypatch.setattr(client, "info", lambda *a, **k: {"maxmemory_policy": "volatile-lru"})
    with pytest.raises(exceptions.ConfigurationError, match="volatile-lru"):
        store.check_config()


def test_check_config_warns_when_unreadable(
    client: fakeredis.FakeRedis,
    store: RedisStore,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(client, "config_get", _refuse)
    monkeypatch.setattr(client, "info", _refuse)
    with caplog.at_level(logging.WARNING, logger="celery_exactonce"):
        store.check_config()
    assert "maxmemory-policy" in caplog.text


def test_check_config_on_an_unreachable_redis_is_unavailable(
    client: fakeredis.FakeRedis, store: RedisStore
) -> None:
    client.connection_pool.connection_kwargs["server"].connected = False
    with pytest.raises(exceptions.StoreUnavailable):
        store.check_config()


@pytest.mark.parametrize("url", [f"http://:{PASSWORD}@h/0", f"redis://:{PASSWORD}@h:notaport/0"])
def test_malformed_url_is_a_configuration_error_without_the_password(url: str) -> None:
    with pytest.raises(exceptions.ConfigurationError) as info:
        RedisStore.from_url(url, namespace="faults", retention=60.0)
    assert info.value.setting == "exactonce_store_url"
    assert PASSWORD not in str(info.value)
