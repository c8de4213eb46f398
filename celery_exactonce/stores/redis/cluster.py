"""The Redis store on a Redis Cluster: ``redis+cluster://`` URLs read, and the cluster's client.

The URL form is pinned::

    redis+cluster://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]
    rediss+cluster://...   (TLS to every node)

The hosts are startup nodes (a port defaults to 6379): any one that answers
tells the client the rest of the cluster. A cluster has no databases, so the
URL has no path (a lone ``/`` is allowed); it takes no query parameter.
Credentials are percent-decoded. Anything else (an empty host, a port that
is not a number, a path, a query, a fragment) is refused as a
``ConfigurationError`` naming ``exactonce_store_url``, the URL redacted.

:class:`ClusterClient` is what the store holds: redis-py's ``RedisCluster``,
built at its first use (building one reads the cluster's slot table, and a
store is built without touching the network), with its command retry off as
on every store client (a script resent after a timeout could apply twice);
redirections (``MOVED``, ``ASK``, ``TRYAGAIN``: the command did not run) it
follows. It also gives the plain client of the node serving a key
(:meth:`ClusterClient.node_client`), for the pipelines a store sends to one
slot: redis-py's cluster pipeline would resend a command that timed out.

Not here: the ``redis://`` client and what a store reads of its client
(:mod:`~celery_exactonce.stores.redis.client`), the slot a namespace's keys
share (:mod:`~celery_exactonce.stores.redis.keys`).
"""

from __future__ import annotations

import threading
from typing import Any, cast
from urllib.parse import urlsplit

import redis
import redis.exceptions as rexc
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.commands.core import Script
from redis.retry import Retry

from celery_exactonce.core import exceptions
from celery_exactonce.stores import redact_url
from celery_exactonce.stores.redis.hosts import refusal, split_netloc

#: The schemes of a Redis Cluster store URL, and whether each speaks TLS.
CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}
#: Redis's default port.
DEFAULT_PORT = 6379


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` names a store on a Redis Cluster."""
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


def is_cluster_client(client: object) -> bool:
    """Whether ``client`` is a :class:`ClusterClient`."""
    return isinstance(client, ClusterClient)


def _refuse(url: str, problem: str) -> exceptions.ConfigurationError:
    return refusal(url, problem, "redis+cluster://[:PASSWORD@]HOST:PORT[,HOST:PORT...]")


def parse(url: str) -> dict[str, Any]:
    """The parts of a cluster URL: ``hosts``, ``tls``, ``username``, ``password``."""
    scheme = url.partition("://")[0]
    if scheme.lower() not in CLUSTER_SCHEMES:
        raise _refuse(url, f"not a Redis Cluster scheme: {scheme!r}")
    try:
        parts = urlsplit(url)
    except ValueError:
        raise _refuse(url, "not a URL") from None
    if parts.query or parts.fragment or "?" in url or "#" in url:
        raise _refuse(url, "a Redis Cluster URL takes no query or fragment")
    if parts.path not in ("", "/"):
        raise _refuse(url, "a Redis Cluster has no databases: the URL has no path")
    found = split_netloc(parts.netloc, DEFAULT_PORT, "node", lambda problem: _refuse(url, problem))
    return {
        "hosts": found.hosts,
        "tls": CLUSTER_SCHEMES[scheme.lower()],
        "username": found.username,
        "password": found.password,
    }


class ClusterClient:
    """A ``RedisCluster`` built at its first use; the store's client on a cluster.

    Attributes the store does not find here are the cluster client's (built
    then). Building it fails with a ``ConnectionError`` (redis-py's) when no
    startup node answers, which the store reports as unavailable.
    """

    def __init__(self, url: str, socket_timeout: float, kwargs: dict[str, Any]) -> None:
        found = parse(url)
        self.where = redact_url(url)
        self.password: str | None = found["password"]
        kwargs = dict(kwargs)
        self._retry = kwargs.pop("retry", None) or Retry(NoBackoff(), 0)
        self._options: dict[str, Any] = {
            "startup_nodes": [
                ClusterNode(host, port)  # type: ignore[no-untyped-call]
                for host, port in found["hosts"]
            ],
            "username": found["username"],
            "password": found["password"],
            "socket_timeout": socket_timeout,
            **({"ssl": True} if found["tls"] else {}),
            **kwargs,
        }
        self._cluster: RedisCluster | None = None
        self._lock = threading.Lock()

    @property
    def cluster(self) -> RedisCluster:
        """The cluster client, built (and the slot table read) at the first call."""
        if self._cluster is None:
            with self._lock:
                if self._cluster is None:
                    try:
                        self._cluster = RedisCluster(retry=self._retry, **self._options)
                    except rexc.RedisClusterException as exc:  # no startup node answered
                        raise rexc.ConnectionError(str(exc)) from exc
        return self._cluster

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cluster, name)

    def register_script(self, script: str) -> Script:
        """A script on this client, its sha computed here from its UTF-8 bytes (no network)."""
        return Script(cast(Any, self), script.encode("utf-8"))

    def node_client(self, key: str) -> redis.Redis:
        """The plain client of the master serving ``key``'s slot (its command retry off too)."""
        cluster = self.cluster
        where = cluster.get_node_from_key(key)  # type: ignore[no-untyped-call]
        return cluster.get_redis_connection(where)

    def primaries(self) -> list[redis.Redis]:
        """The plain client of every master."""
        cluster = self.cluster
        nodes = cluster.get_primaries()  # type: ignore[no-untyped-call]
        return [cluster.get_redis_connection(node) for node in nodes]

    def refresh(self) -> None:
        """Read the slot table again (after a ``MOVED``: a slot changed masters)."""
        if self._cluster is not None:
            self._cluster.nodes_manager.initialize()

    def close(self) -> None:
        """Close every node's connections (nothing when the client was never built)."""
        if self._cluster is not None:
            self._cluster.close()


def cluster_client(url: str, socket_timeout: float, kwargs: dict[str, Any]) -> redis.Redis:
    """The store's client for a cluster URL (a :class:`ClusterClient`, used as a client)."""
    return cast(redis.Redis, ClusterClient(url, socket_timeout, kwargs))
