"""Job stores, and :func:`store_from_url` to pick one from ``exactonce_store_url``.

Drivers are optional extras, imported only when a store that needs them is
built; a missing one raises :class:`~celery_exactonce.core.exceptions.ConfigurationError`
with the ``pip install`` line that fixes it.

========================================  =============================  ==========
URL                                       store                          extra
========================================  =============================  ==========
``memory://``                             :class:`InMemoryStore`         (none)
``redis://``, ``rediss://``, ``unix://``  ``RedisStore``                 ``redis``
``redis+sentinel://H:P[,H:P]/SERVICE``    ``RedisStore`` (its master)    ``redis``
``redis+cluster://H:P[,H:P]``             ``RedisStore`` (a cluster)     ``redis``
``postgresql://`` (``postgres://``)       ``SqlStore`` (psycopg 3)       ``postgres``
``mysql://``, ``mariadb://``              ``SqlStore`` (PyMySQL)         ``mysql``
``sqlite:///path/to/file.db``             ``SqlStore``                   ``sqlite``
========================================  =============================  ==========

An explicit SQLAlchemy driver (``postgresql+psycopg2://``) is used as given.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable
from typing import Any, Protocol
from urllib.parse import quote, quote_plus, unquote, unquote_plus, urlsplit

from celery_exactonce.core import exceptions
from celery_exactonce.core.jobs import KEEP, Compaction
from celery_exactonce.stores import shards
from celery_exactonce.stores.base import FORMAT_VERSION, StateStore
from celery_exactonce.stores.memory import InMemoryStore

__all__ = [
    "FORMAT_VERSION",
    "KNOWN_SCHEMES",
    "REDACTED",
    "InMemoryStore",
    "StateStore",
    "StoreSettings",
    "open_store",
    "redact_message",
    "redact_secrets",
    "redact_url",
    "store_from_url",
    "url_secrets",
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
KNOWN_SCHEMES = frozenset({"memory", "django", *_REDIS_SCHEMES, *_SQL_DRIVERS})


def validate_namespace(namespace: object, setting: str = "exactonce_namespace") -> str:
    """A namespace is 1-64 characters of letters, digits, ``_``, ``.`` and ``-``."""
    if not isinstance(namespace, str) or not _NAMESPACE_RE.match(namespace):
        raise exceptions.ConfigurationError(
            f"{setting}={namespace!r}: a namespace is 1-64 characters of letters, digits, "
            "'_', '.' and '-', starting with a letter or digit",
            setting=setting,
        )
    return namespace


#: Query (or ``key=value``) parameter names whose value is a credential, matched
#: case-insensitively anywhere in the name (``password``, ``sslpassword``,
#: ``auth_token``, ``X-Api-Key``...). Over-redacting a harmless value is cheap;
#: printing a password is not.
_SECRET_NAME_RE = re.compile(
    r"pass|pwd|secret|token|auth|credential|api[-_]?key|private|signature|sig$", re.IGNORECASE
)
#: ``name=value`` pairs in free text (a libpq conninfo inside a query value, a
#: driver message): the value is a quoted string or runs to a separator.
_PAIR_RE = re.compile(
    r"(?P<name>[A-Za-z_][A-Za-z0-9_.-]*)(?P<eq>\s*=\s*)"
    r"(?P<value>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|[^\s&;,'\"]+)"
)
#: ``scheme://user:password@`` inside free text.
_USERINFO_RE = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^\s/:@?#]*):[^\s@/?#]*@")
REDACTED = "***"
_UNPARSABLE = "<unparsable url>"


def _secret_name(name: str) -> bool:
    return bool(_SECRET_NAME_RE.search(unquote_plus(name)))


def _redact_pairs(text: str) -> str:
    """``text`` with the value of every credential-named ``name=value`` pair blanked."""
    return _PAIR_RE.sub(
        lambda m: (
            m.group(0)
            if not _secret_name(m.group("name"))
            else f"{m.group('name')}{m.group('eq')}{REDACTED}"
        ),
        text,
    )


def _holds_pair(text: str) -> bool:
    """Whether percent-decoded ``text`` carries a credential-named ``key=value`` pair."""
    decoded = unquote_plus(text)
    return _redact_pairs(decoded) != decoded


def _redact_query(query: str) -> str:
    """A query string with credential parameters blanked (names and order kept).

    A parameter whose own value holds a credential-named ``key=value`` (a libpq
    conninfo, percent-encoded or not) is blanked whole.
    """
    if not query:
        return query
    out = []
    for part in re.split(r"([&;])", query):
        if part in ("&", ";"):
            out.append(part)
            continue
        name, sep, value = part.partition("=")
        if sep and (_secret_name(name) or _holds_pair(value)):
            out.append(f"{name}={REDACTED}")
        elif not sep and _holds_pair(name):
            out.append(REDACTED)
        else:
            out.append(part)
    return "".join(out)


def redact_url(url: str) -> str:
    """``url`` with every credential replaced by ``***`` (for logs, errors and CLI output).

    Blanks the user-info password (``user:***@``, ``:***@`` for Redis's
    password-only form), every query parameter whose name says it holds a
    credential (``password``, ``passwd``, ``pwd``, ``sslpassword``, ``token``,
    ``auth``..., in any case), and any parameter whose value carries such a
    ``key=value`` pair (a libpq conninfo); the fragment likewise. A user name
    alone is kept. A URL too malformed to parse is replaced whole: it may hold
    a password where a parser would not look for one.
    """
    if not isinstance(url, str):
        return _UNPARSABLE
    if "://" not in url:
        # Not a URL: a bare conninfo ("host=db password=x") or junk.
        return _UNPARSABLE if "@" in url else _redact_pairs(url)
    try:
        parts = urlsplit(url)
        _check_ports(parts.netloc)
    except ValueError:
        return _UNPARSABLE
    netloc = parts.netloc
    userinfo, at, hostport = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.partition(':')[0]}:{REDACTED}@{hostport}"
    if _cut_userinfo(url, parts.netloc):
        return _UNPARSABLE
    path = _redact_pairs(parts.path) if "=" in parts.path else parts.path
    query, fragment = _redact_query(parts.query), _redact_query(parts.fragment)
    if (netloc, path, query, fragment) == (parts.netloc, parts.path, parts.query, parts.fragment):
        return url
    text = f"{url.split('://', 1)[0]}://{netloc}{path}"
    if query or "?" in url:
        text += f"?{query}"
    if fragment or "#" in url:
        text += f"#{fragment}"
    return text


def _check_ports(netloc: str) -> None:
    """Raise ``ValueError`` unless each ``host:port`` of ``netloc`` has a valid port or none
    (Sentinel's netloc is a comma list, ``:pw@h1:26379,h2:26379``: each host is checked)."""
    for host in netloc.rpartition("@")[2].split(","):
        urlsplit(f"x://{host}").port  # noqa: B018 (raises ValueError on a malformed port)


def _cut_userinfo(url: str, netloc: str) -> bool:
    """Whether a raw ``/``, ``?`` or ``#`` in a password cut it short (``u:pa/ss@host``).

    The parser then ends the host part early and leaves the rest of the
    password in the path, query or fragment: an ``@`` after a host part that
    has none (or has a ``:``, read as a port).
    """
    rest = url.split("://", 1)[1][len(netloc) :]
    return bool(netloc) and "@" in rest and ("@" in netloc or ":" in netloc)


def url_secrets(url: str) -> list[str]:
    """Every credential in ``url``: as written, decoded and encoded (what a driver may echo)."""
    if not isinstance(url, str):
        return []
    found: list[str] = []

    def add(raw: str) -> None:
        for form in (raw, unquote(raw), unquote_plus(raw)):
            value = form.strip("'\"")
            for shown in (value, quote(value, safe=""), quote_plus(value, safe="")):
                if shown and shown not in found:
                    found.append(shown)

    def add_pairs(text: str) -> None:
        for match in _PAIR_RE.finditer(text):
            if _secret_name(match.group("name")):
                add(match.group("value"))

    if "://" not in url:
        add_pairs(url)
        return found
    try:
        parts = urlsplit(url)
    except ValueError:
        head = url.split("://", 1)[1]
        userinfo = head.rpartition("@")[0]
        if ":" in userinfo:
            add(userinfo.split(":", 1)[1])
        add_pairs(url)
        return found
    userinfo, at, _ = parts.netloc.rpartition("@")
    if _cut_userinfo(url, parts.netloc):
        userinfo, at, _ = url.split("://", 1)[1].rpartition("@")
    if at and ":" in userinfo:
        add(userinfo.split(":", 1)[1])
    for section in (parts.query, parts.fragment):
        for part in re.split(r"[&;]", section):
            name, sep, value = part.partition("=")
            if sep and _secret_name(name):
                add(value)
            for text in (value, unquote(value), unquote_plus(value)):
                add_pairs(text)
    add_pairs(parts.path)
    return found


def redact_secrets(message: str, secrets: Iterable[str]) -> str:
    """``message`` with each of ``secrets`` blanked, and any credential it spells out itself.

    Besides the given values (longest first, so one that contains another goes
    whole), credential-named ``key=value`` pairs and ``scheme://user:pass@``
    user-info in the text are blanked too: a driver may echo a connection
    string this process never saw.
    """
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        message = message.replace(secret, REDACTED)
    message = _USERINFO_RE.sub(lambda m: f"{m.group('head')}:{REDACTED}@", message)
    return _redact_pairs(message)


def redact_message(message: str, url: str) -> str:
    """``message`` with every credential of ``url`` blanked out wherever a driver echoed it.

    Covers the user-info password and credential query parameters, both as
    written in the URL and percent-decoded, and the URL itself (redacted).
    """
    return redact_secrets(message, url_secrets(url))


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
        raise not_a_store_url(url, "is not a URL")
    scheme = url.split("://", 1)[0].lower()
    base = scheme.split("+", 1)[0]
    compaction = options.get("compaction", KEEP)
    if base == "memory":
        return InMemoryStore(namespace, retention=retention, compaction=compaction)
    if base in _REDIS_SCHEMES:
        count = options.pop("shards", 1)
        shards.check_setting(count, url, redact_url(url))
        if count > 1:  # a Redis Cluster (checked): the namespace over several slots
            sharded = _import("celery_exactonce.stores.redis.sharded", "redis")
            return sharded.ShardedRedisStore.from_url(  # type: ignore[no-any-return]
                url, namespace=namespace, retention=retention, shards=count, **options
            )
        module = _import("celery_exactonce.stores.redis.store", "redis")
        return module.RedisStore.from_url(  # type: ignore[no-any-return]
            url, namespace=namespace, retention=retention, **options
        )
    if base == "django":
        module = _import("celery_exactonce.contrib.django.store", "django")
        return module.DjangoStore.from_url(  # type: ignore[no-any-return]
            url, namespace=namespace, retention=retention, **options
        )
    if base in _SQL_DRIVERS:
        driver, extra = _SQL_DRIVERS[base]
        sa_url = url if "+" in scheme else driver + url[len(scheme) :]
        module = _import("celery_exactonce.stores.sql.store", extra)
        return module.SqlStore.from_url(  # type: ignore[no-any-return]
            sa_url, namespace=namespace, retention=retention, **options
        )
    raise not_a_store_url(url, f"has an unknown scheme {scheme!r}")


def not_a_store_url(url: object, why: str) -> exceptions.ConfigurationError:
    """The refusal of ``url`` (``why`` it names no store), listing what names one."""
    return exceptions.ConfigurationError(
        f"exactonce_store_url={redact_url(str(url))!r} {why} (expected redis://, rediss://, "
        "redis+sentinel://, redis+cluster://, unix://, postgresql://, mysql://, mariadb://, "
        "sqlite:///, django:// or memory://)",
        setting="exactonce_store_url",
    )


class StoreSettings(Protocol):
    """What :func:`open_store` reads of a configuration: an
    :class:`~celery_exactonce.config.ExactOnceConfig` has it all (this package
    does not import the configuration, which imports it)."""

    @property
    def store_url(self) -> str: ...

    @property
    def namespace(self) -> str: ...

    @property
    def retention(self) -> float: ...

    @property
    def key_prefix(self) -> str: ...

    @property
    def store_timeout(self) -> float: ...

    @property
    def table_prefix(self) -> str: ...

    @property
    def min_replicas(self) -> int: ...

    @property
    def shards(self) -> int: ...

    @property
    def compaction(self) -> Compaction: ...


def open_store(config: StoreSettings, *, setup: bool = True) -> StateStore:
    """Build, set up and check the store of ``config``: what every node does at start-up.

    Runs :meth:`StateStore.setup` (schema and format version) and the backend's own
    start-up checks (Redis must run with ``maxmemory-policy noeviction``, and have
    ``exactonce_min_replicas`` replicas), unless ``setup`` is false: then nothing
    touches the network (a worker's pool child, whose parent checked at start-up).

    Raises
    ------
    ConfigurationError
        The URL is unusable or the backend is misconfigured
        (``exactonce_min_replicas`` on a store other than Redis).
    SchemaMismatch
        The store holds a newer format than this code writes.
    StoreUnavailable
        The store does not answer.
    """
    url = config.store_url
    base = url.split("://", 1)[0].lower().split("+", 1)[0]
    shards.check_setting(config.shards, url, redact_url(url))
    options: dict[str, Any] = {"compaction": config.compaction}
    if base in _REDIS_SCHEMES:
        options.update(prefix=config.key_prefix, socket_timeout=config.store_timeout)
        options.update(min_replicas=config.min_replicas, shards=config.shards)
    elif config.min_replicas:
        raise exceptions.ConfigurationError(
            f"exactonce_min_replicas={config.min_replicas}: only a Redis store waits for "
            f"replicas (store {redact_url(url)}); on PostgreSQL use synchronous_commit "
            "with a synchronous standby instead (docs/howto/store-sql.md)",
            setting="exactonce_min_replicas",
        )
    elif base in _SQL_DRIVERS:
        options["table_prefix"] = config.table_prefix
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
