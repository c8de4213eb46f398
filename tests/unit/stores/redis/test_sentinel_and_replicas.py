"""Sentinel URLs and ``exactonce_min_replicas`` with no server: parsing, redaction, refusals.

The same against real masters, replicas and sentinels: tests/integration/test_sentinel.py.
"""

from __future__ import annotations

from typing import Any

import fakeredis
import pytest
from redis.sentinel import SentinelConnectionPool

from celery_exactonce import ConfigurationError, ExactOnceConfig, open_store
from celery_exactonce.stores import redact_message, redact_url, store_from_url, url_secrets
from celery_exactonce.stores.redis.client import same_server
from celery_exactonce.stores.redis.sentinel import parse
from celery_exactonce.stores.redis.store import RedisStore

URL = "redis+sentinel://:pw-s3cret@h1:26379,h2:26380,h3/mymaster/2"


def test_a_sentinel_url_names_its_sentinels_service_database_and_credentials() -> None:
    found = parse("redis+sentinel://u:p%40w@h1:1,h2/svc/3?sentinel_password=sp")
    assert found["hosts"] == [("h1", 1), ("h2", 26379)]
    assert (found["service"], found["db"], found["tls"]) == ("svc", 3, False)
    assert (found["username"], found["password"], found["sentinel_password"]) == ("u", "p@w", "sp")
    assert parse("rediss+sentinel://h/svc")["tls"] is True
    assert parse("redis+sentinel://h/svc")["db"] == 0


def test_a_sentinel_url_is_redacted_with_its_host_list_kept() -> None:
    assert redact_url(URL) == "redis+sentinel://:***@h1:26379,h2:26380,h3/mymaster/2"
    with_query = "redis+sentinel://u:pw1@h1:1,h2:2/m?sentinel_password=pw2"
    assert redact_url(with_query) == "redis+sentinel://u:***@h1:1,h2:2/m?sentinel_password=***"
    assert {"pw1", "pw2"} <= set(url_secrets(with_query))
    message = redact_message(f"cannot reach {with_query}: auth pw1 / pw2", with_query)
    assert "pw1" not in message and "pw2" not in message


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://:pw@h1:x,h2:1/m",
        "redis+sentinel://:pw@h1:1/",
        "redis+sentinel://:pw@h1:1",
        "redis+sentinel://:pw@h1:1/m/zero",
        "redis+sentinel://:pw@h1:1/m/0/extra",
        "redis+sentinel://:pw@h1,,h2/m",
        "redis+sentinel://:pw@h1/m?password=x",
    ],
)
def test_a_malformed_sentinel_url_is_refused_naming_the_setting(url: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        store_from_url(url, namespace="n")
    assert caught.value.setting == "exactonce_store_url"
    assert "exactonce_store_url" in str(caught.value)
    assert "pw" not in str(caught.value).replace("password", "")


def test_a_sentinel_store_is_built_without_touching_the_network() -> None:
    store = store_from_url(URL, namespace="n")
    try:
        assert isinstance(store, RedisStore)
        pool = store._client.connection_pool
        assert isinstance(pool, SentinelConnectionPool)
        assert pool.service_name == "mymaster"
        assert pool.connection_kwargs["db"] == 2
        assert "pw-s3cret" not in repr(store)
        # the broker's connection arguments never count as the same server
        assert not same_server(store._client, pool.connection_kwargs)
        assert store.shares_server(dict(pool.connection_kwargs, host="h1", port=26379)) is None
    finally:
        store.close()


@pytest.mark.parametrize("value", [-1, 1.5, True, "1"])
def test_min_replicas_must_be_a_non_negative_integer(value: Any) -> None:
    with pytest.raises(ConfigurationError) as caught:
        ExactOnceConfig(store_url="redis://h:6379/0", min_replicas=value)
    assert caught.value.setting == "exactonce_min_replicas"


@pytest.mark.parametrize("url", ["memory://", "sqlite:////tmp/exactonce-never-made.db"])
def test_min_replicas_on_a_store_other_than_redis_is_refused(url: str) -> None:
    config = ExactOnceConfig(store_url=url, min_replicas=1)
    with pytest.raises(ConfigurationError) as caught:
        open_store(config, setup=False)
    assert caught.value.setting == "exactonce_min_replicas"
    assert "synchronous_commit" in str(caught.value)


def test_min_replicas_turns_the_one_step_enqueue_off() -> None:
    client = fakeredis.FakeRedis()
    kwargs = dict(client.connection_pool.connection_kwargs)
    plain = RedisStore(client, namespace="n", retention=60.0)
    waiting = RedisStore(client, namespace="n", retention=60.0, min_replicas=1)
    assert (plain._min_replicas, waiting._min_replicas) == (0, 1)
    assert waiting.shares_server(kwargs) is None
    assert plain._counted == frozenset()  # N = 0: no WAIT, no extra round trip
