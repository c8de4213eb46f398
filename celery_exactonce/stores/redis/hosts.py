"""The host list and credentials of a Redis URL that names several servers.

``redis+sentinel://`` and ``redis+cluster://`` URLs (and their ``rediss+``
forms) name their servers as ``[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]…]``;
:func:`split_netloc` reads that part for both, refusing a missing host or a
bad port with the caller's own error; :func:`refusal` is that error, naming
``exactonce_store_url`` (redacted) and the form expected.

Not here: the rest of each URL (the Sentinel service and database, the
cluster's lack of a path: :mod:`~celery_exactonce.stores.redis.sentinel`,
:mod:`~celery_exactonce.stores.redis.cluster`), redaction
(:func:`~celery_exactonce.stores.redact_url`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from celery_exactonce.core import exceptions
from celery_exactonce.stores import redact_url


@dataclass(frozen=True)
class Netloc:
    """The servers of a URL, and the credentials of its user info (None: not given)."""

    hosts: list[tuple[str, int]]
    username: str | None
    password: str | None


def split_netloc(
    netloc: str,
    default_port: int,
    server: str,
    refuse: Callable[[str], exceptions.ConfigurationError],
) -> Netloc:
    """``netloc`` read as a comma-separated host list; ``server`` names one in errors.

    ``refuse(problem)`` builds the error raised for a host without a name or a
    port that is not a number from 1 to 65535.
    """
    userinfo, at, hostlist = netloc.rpartition("@")
    hosts: list[tuple[str, int]] = []
    for item in hostlist.split(","):
        try:
            host = urlsplit(f"x://{item}")
            port = host.port or default_port
        except ValueError:
            raise refuse(f"a {server}'s port is not a number from 1 to 65535") from None
        if not host.hostname:
            raise refuse(f"every {server} needs a host")
        hosts.append((host.hostname, port))
    username, _, password = userinfo.partition(":") if at else ("", "", "")
    return Netloc(hosts, unquote(username) or None, unquote(password) or None)


def refusal(url: str, problem: str, expected: str) -> exceptions.ConfigurationError:
    """The error refusing store URL ``url`` for ``problem``; ``expected`` is its form."""
    return exceptions.ConfigurationError(
        f"exactonce_store_url={redact_url(url)!r}: {problem} (expected {expected})",
        setting="exactonce_store_url",
    )
