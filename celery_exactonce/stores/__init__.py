"""Job stores, and :func:`store_from_url` to pick one from ``exactonce_store_url``.

Drivers are optional extras, imported only when a store that needs them is
built; a missing one raises :class:`~celery_exactonce.exceptions.ConfigurationError`
with the ``pip install`` line that fixes it.

========================================  =============================  ==========
URL                                       store                          extra
========================================  =============================  ==========
``memory://``                             :class:`InMemoryStore`         (none)
``redis://``, ``rediss://``, ``unix://``  ``RedisStore``                 ``redis``
``postgresql://`` (``postgres://``)       ``SqlStore`` (psycopg 3)       ``postgres``
``mysql://``, ``mariadb://``              ``SqlStore`` (PyMySQL)         ``mysql``
``sqlite:///path/to/file.db``             ``SqlStore``                   ``sqlite``
========================================  =============================  ==========

A SQLAlchemy URL with an explicit driver (``postgresql+psycopg2://``) is used
as given.
"""

from __future__ import annotations

import importlib
import re
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from celery_exactonce import exceptions
from celery_exactonce.stores.base import FORMAT_VERSION, StateStore
from celery_exactonce.stores.memory import InMemoryStore

if TYPE_CHECKING:
    from celery_exactonce.config import ExactOnceConfig

__all__ = [
    "FORMAT_VERSION",
    "KNOWN_SCHEMES",
    "InMemoryStore",
    "StateStore",
    "open_store",
    "redact_message",
    "redact_url",
    "store_from_url",
]

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

_SQL_DRIVERS = {
    "postgresql": ("postgresql+psycopg", "postgres"),
    "postgres": ("postgresql+psycopg", "postgres"),
    "mysql": ("mysql+pymysql", "mysql"),
    "mariadb": ("mysql+pymysql", "mysql"),
    "sqlite": ("sqlite", "sqlite"),
}

_REDIS_SCHEMES = frozenset({"redis", "rediss", "unix"})

#: URL schemes (before any ``+driver``) that name a store.
KNOWN_SCHEMES = frozenset({"memory", *_REDIS_SCHEMES, *_SQL_DRIVERS})


def validate_namespace(namespace: object, setting: str = "exactonce_namespace") -> str:
    """A namespace is 1-64 characters of letters, digits, ``_``, ``.`` and ``-``."""
    if not isinstance(namespace, str) or not _NAMESPACE_RE.match(namespace):
        raise exceptions.ConfigurationError(
            f"{setting}={namespace!r}: a namespace is 1-64 characters of letters, digits, "
            "'_', '.' and '-', starting with a letter or digit",
            setting=setting,
        )
    return namespace


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for logs, errors and CLI output).

    A URL too malformed to parse is replaced whole: it may hold a password
    where a parser would not look for one.
    """
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<unparsable url>"
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{parts.username or ''}:***@{host}{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def redact_message(message: str, url: str) -> str:
    """``message`` with the password of ``url`` blanked out wherever a driver echoed it."""
    try:
        secret = urlsplit(url).password if "://" in url else None
    except ValueError:
        return message
    return message.replace(secret, "***") if secret else message


def store_from_url(
    url: str,
    *,
    namespace: str = "default",
    retention: float = 7 * 86_400,
    **options: Any,
) -> StateStore:
    """Build the store ``url`` names, bound to ``namespace``.

    Raises
    ------
    ConfigurationError
        The URL is malformed, its scheme unknown, or its driver not installed.
        The message names ``exactonce_store_url`` and shows the URL redacted.
    """
    validate_namespace(namespace)
    if not isinstance(url, str) or "://" not in url:
        raise exceptions.ConfigurationError(
            f"exactonce_store_url={redact_url(str(url))!r} is not a URL "
            "(expected redis://, postgresql://, mysql://, sqlite:/// or memory://)",
            setting="exactonce_store_url",
        )
    scheme = url.split("://", 1)[0].lower()
    base = scheme.split("+", 1)[0]
    if base == "memory":
        return InMemoryStore(namespace, retention=retention)
    if base in _REDIS_SCHEMES:
        module = _import("celery_exactonce.stores.redis", "redis")
        store: StateStore = module.RedisStore.from_url(
            url, namespace=namespace, retention=retention, **options
        )
        return store
    if base in _SQL_DRIVERS:
        driver, extra = _SQL_DRIVERS[base]
        sa_url = url if "+" in scheme else driver + url[len(scheme) :]
        module = _import("celery_exactonce.stores.sql", extra)
        store = module.SqlStore.from_url(
            sa_url, namespace=namespace, retention=retention, **options
        )
        return store
    raise exceptions.ConfigurationError(
        f"exactonce_store_url={redact_url(url)!r}: unknown scheme {scheme!r} "
        "(expected redis://, postgresql://, mysql://, sqlite:/// or memory://)",
        setting="exactonce_store_url",
    )


def open_store(config: ExactOnceConfig, *, setup: bool = True) -> StateStore:
    """Build, set up and check the store of ``config``: what every node does at start-up.

    Runs :meth:`StateStore.setup` (schema and format version) and the
    backend's own start-up checks (Redis must run with
    ``maxmemory-policy noeviction``), unless ``setup`` is false: then nothing
    touches the network (a worker's pool child, whose parent checked at start-up).

    Raises
    ------
    ConfigurationError
        The URL is unusable or the backend is misconfigured.
    SchemaMismatch
        The store holds a newer format than this code writes.
    StoreUnavailable
        The store does not answer.
    """
    url = config.store_url
    base = url.split("://", 1)[0].lower().split("+", 1)[0]
    options: dict[str, Any] = {}
    if base in _REDIS_SCHEMES:
        options = {"prefix": config.key_prefix, "socket_timeout": config.store_timeout}
    elif base in _SQL_DRIVERS:
        options = {"table_prefix": config.table_prefix}
    store = store_from_url(url, namespace=config.namespace, retention=config.retention, **options)
    if not setup:
        return store  # no I/O: the caller's process (or its parent) already set it up
    try:
        store.setup()
        check = getattr(store, "check_config", None)
        if check is not None:
            check()
    except BaseException:
        store.close()
        raise
    return store


def _import(module: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if exc.name and exc.name.startswith("celery_exactonce"):
            raise
        raise exceptions.ConfigurationError(
            f"the {extra} store needs an optional dependency ({exc.name}): "
            f"pip install 'celery-exactonce[{extra}]'",
            setting="exactonce_store_url",
        ) from exc
