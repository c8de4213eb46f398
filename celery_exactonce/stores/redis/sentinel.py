"""The Redis store behind Sentinel: ``redis+sentinel://`` URLs read, and the master's client built.

The URL form is pinned::

    redis+sentinel://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/SERVICE[/DB]
    rediss+sentinel://...   (TLS to the sentinels and to the master)

A port defaults to 26379 (Sentinel's). The user-info is the master's
credentials; the sentinels' own, when they have any, are the query
parameters ``sentinel_password`` (and ``sentinel_username``). Credentials are
percent-decoded. Anything else in the URL (another query parameter, an empty
host, a port that is not a number, a missing service, a database that is not
a number) is refused as a ``ConfigurationError`` naming
``exactonce_store_url``, the URL redacted.

:func:`sentinel_client` builds redis-py's ``Sentinel(...).master_for(SERVICE)``:
a plain ``redis.Redis`` on a ``SentinelConnectionPool``, which asks the
sentinels for the master's address at each new connection, so after a
failover (a connection error, or a ``READONLY`` reply from a demoted
master) the next connection reaches the new master. Its own command retry is
off, as on every store client.

Not here: the ``redis://`` client and what a store reads of its client
(:mod:`~celery_exactonce.stores.redis.client`), why a Sentinel store never
takes the one-step enqueue (:func:`~celery_exactonce.stores.redis.client.same_server`).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
from redis.sentinel import Sentinel, SentinelConnectionPool

from celery_exactonce.core import exceptions
from celery_exactonce.stores.redis.hosts import refusal, split_netloc

#: The schemes of a Sentinel store URL, and whether each speaks TLS.
SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}
#: Sentinel's default port.
DEFAULT_PORT = 26379
_QUERY = frozenset({"sentinel_password", "sentinel_username"})


def is_sentinel_url(url: str) -> bool:
    """Whether ``url`` names a store behind Sentinel."""
    return url.split("://", 1)[0].lower() in SENTINEL_SCHEMES


def is_sentinel_client(client: redis.Redis) -> bool:
    """Whether ``client`` reaches its server through Sentinel (the master it finds)."""
    return isinstance(client.connection_pool, SentinelConnectionPool)


def _refuse(url: str, problem: str) -> exceptions.ConfigurationError:
    return refusal(
        url, problem, "redis+sentinel://[:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]"
    )


def parse(url: str) -> dict[str, Any]:
    """The parts of a Sentinel URL: ``hosts``, ``service``, ``db``, ``tls``, credentials."""
    scheme = url.partition("://")[0]
    if scheme.lower() not in SENTINEL_SCHEMES:
        raise _refuse(url, f"not a Sentinel scheme: {scheme!r}")
    parts = urlsplit(url)
    if parts.fragment:
        raise _refuse(url, "a Sentinel URL has no fragment")
    found = split_netloc(
        parts.netloc, DEFAULT_PORT, "sentinel", lambda problem: _refuse(url, problem)
    )
    path = [unquote(p) for p in parts.path.split("/")[1:]]
    if path and path[-1] == "":
        path.pop()  # a trailing slash
    if not path or not path[0] or len(path) > 2:
        raise _refuse(url, "the path must be /SERVICE or /SERVICE/DB")
    if len(path) == 2 and not path[1].isdigit():
        raise _refuse(url, f"the database must be a number, got {path[1]!r}")
    query: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name not in _QUERY:
            raise _refuse(url, f"unknown parameter {name!r} (known: {', '.join(sorted(_QUERY))})")
        query[name] = value
    return {
        "hosts": found.hosts,
        "service": path[0],
        "db": int(path[1]) if len(path) == 2 else 0,
        "tls": SENTINEL_SCHEMES[scheme.lower()],
        "username": found.username,
        "password": found.password,
        "sentinel_username": query.get("sentinel_username") or None,
        "sentinel_password": query.get("sentinel_password") or None,
    }


def sentinel_client(url: str, socket_timeout: float, kwargs: dict[str, Any]) -> redis.Redis:
    """A client on the master of the service ``url`` names; ``kwargs`` go to its connections."""
    found = parse(url)
    tls: dict[str, Any] = {"ssl": True} if found["tls"] else {}
    sentinel_kwargs: dict[str, Any] = {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": kwargs.get("socket_connect_timeout", socket_timeout),
        "username": found["sentinel_username"],
        "password": found["sentinel_password"],
        **tls,
    }
    sentinel = Sentinel(found["hosts"], sentinel_kwargs=sentinel_kwargs)  # type: ignore[no-untyped-call]
    client: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call]
        found["service"],
        redis_class=redis.Redis,
        db=found["db"],
        username=found["username"],
        password=found["password"],
        socket_timeout=socket_timeout,
        **tls,
        **kwargs,
    )
    return client
