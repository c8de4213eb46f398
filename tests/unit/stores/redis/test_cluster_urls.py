"""Redis Cluster URLs with no server: parsing, redaction, refusals, a store built offline.

The same on a real cluster: tests/integration/test_cluster.py, and the contract
suite with ``EXACTONCE_TEST_CLUSTER=1``.
"""

from __future__ import annotations

import pytest

from celery_exactonce import ConfigurationError, StoreUnavailable
from celery_exactonce.stores import redact_message, redact_url, store_from_url, url_secrets
from celery_exactonce.stores.redis.client import same_server
from celery_exactonce.stores.redis.cluster import ClusterClient, parse
from celery_exactonce.stores.redis.store import RedisStore

URL = "redis+cluster://:pw-s3cret@h1:7000,h2:7001,h3"


def test_a_cluster_url_names_its_startup_nodes_and_credentials() -> None:
    found = parse("redis+cluster://u:p%40w@h1:1,h2/")
    assert found["hosts"] == [("h1", 1), ("h2", 6379)]
    assert (found["username"], found["password"], found["tls"]) == ("u", "p@w", False)
    assert parse("rediss+cluster://h")["tls"] is True
    assert parse("redis+cluster://h")["password"] is None


def test_a_cluster_url_is_redacted_with_its_host_list_kept() -> None:
    assert redact_url(URL) == "redis+cluster://:***@h1:7000,h2:7001,h3"
    assert "pw-s3cret" in url_secrets(URL)
    message = redact_message(f"cannot reach {URL}: auth pw-s3cret", URL)
    assert "pw-s3cret" not in message


@pytest.mark.parametrize(
    "url",
    [
        "redis+cluster://:pw@h1:x,h2:1",
        "redis+cluster://:pw@h1:1/0",
        "redis+cluster://:pw@h1:1/db",
        "redis+cluster://:pw@h1,,h2",
        "redis+cluster://:pw@",
        "redis+cluster://:pw@h1?password=x",
        "redis+cluster://:pw@h1#x",
    ],
)
def test_a_malformed_cluster_url_is_refused_naming_the_setting(url: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        store_from_url(url, namespace="n")
    assert caught.value.setting == "exactonce_store_url"
    assert "exactonce_store_url" in str(caught.value)
    assert "pw" not in str(caught.value).replace("password", "")


def test_a_cluster_store_is_built_without_touching_the_network() -> None:
    # Given nodes nobody listens on: building the store reads no slot table
    store = store_from_url("redis+cluster://:pw-s3cret@127.0.0.1:1,127.0.0.1:2", namespace="n")
    try:
        assert isinstance(store, RedisStore)
        client = store._client
        assert isinstance(client, ClusterClient)
        assert client._cluster is None
        assert "pw-s3cret" not in repr(store)
        # no one-step enqueue on a cluster, whatever the broker's arguments
        kwargs = {"host": "127.0.0.1", "port": 1, "db": 0}
        assert not same_server(client, kwargs)
        assert store.shares_server(kwargs) is None
    finally:
        store.close()


def test_min_replicas_on_a_cluster_builds_a_waiting_store_touching_no_server() -> None:
    store = store_from_url(URL, namespace="n", min_replicas=1, socket_timeout=2.0)
    try:
        assert isinstance(store, RedisStore)
        assert store._min_replicas == 1 and store._wait_ms == 2000
        assert store._counted == frozenset(
            {"create", "create_unique", "transition", "enqueue", "entry_write"}
        )
        client = store._client
        assert isinstance(client, ClusterClient) and client._cluster is None
        # the socket waits for the script, then for WAIT
        assert client._options["socket_timeout"] == 4.0
        assert "pw-s3cret" not in repr(store)
    finally:
        store.close()


@pytest.mark.timeout(30)
def test_a_cluster_no_node_answers_is_unavailable_with_the_password_blanked() -> None:
    store = store_from_url(
        "redis+cluster://:pw-s3cret@127.0.0.1:1", namespace="n", socket_timeout=0.5
    )
    try:
        with pytest.raises(StoreUnavailable) as caught:
            store.ping()
        assert "pw-s3cret" not in str(caught.value)
    finally:
        store.close()


def test_a_cluster_master_with_too_few_replicas_is_refused_by_its_address() -> None:
    store = store_from_url(URL, namespace="n", min_replicas=1)
    try:
        counts = {"10.0.0.1:7000": 1, "10.0.0.2:7000": 0}
        with pytest.raises(ConfigurationError) as caught:
            store._enough_replicas(counts)
        assert caught.value.setting == "exactonce_min_replicas"
        message = str(caught.value)
        assert "master 10.0.0.2:7000 has 0 connected replica(s)" in message
        assert "exactonce_min_replicas=1" in message and "10.0.0.1" not in message
        assert "pw-s3cret" not in message and "redis+cluster://:***@h1:7000" in message
        assert store._enough_replicas({"10.0.0.1:7000": 1}) == {"10.0.0.1:7000": 1}
    finally:
        store.close()
