"""Who may see the dashboard and act through it: auth, CSRF tokens, hosts, loopback.

Pure functions and values, no web framework: the command checks its bind
address with them before importing Starlette, and :mod:`celery_exactonce.web.app`
calls them on each request.

* :class:`Auth`: a bearer token and/or an HTTP basic user and password.
  With a token alone, a browser logs in by basic auth with any user name and
  the token as its password. Credentials are compared in constant time and
  never shown (their ``repr`` hides them).
* CSRF: every form of an action carries a token, ``<issued>.<mac>``, the
  HMAC-SHA256 under a secret of this process (random at start: a restart
  voids the tokens of pages shown before it) of when it was issued and the
  path the form posts to; it is good for :data:`CSRF_MAX_AGE`. A POST is also
  refused unless its ``Origin`` (or, without one, its ``Referer``) names the
  host the request was sent to.
* :func:`is_loopback`: whether a bind address is this machine only. The
  command refuses any other without auth.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import ipaddress
import time
from urllib.parse import urlsplit

#: Seconds a form's CSRF token is good for: a page left open over a night is reloaded.
CSRF_MAX_AGE = 12 * 3600
#: Host names that are this machine, whatever they resolve to elsewhere.
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
#: The realm a browser's login prompt shows.
REALM = "celery-exactonce"


@dataclasses.dataclass(frozen=True)
class Auth:
    """The credentials the dashboard asks for: a bearer ``token``, basic ``user`` and
    ``password``, or both (either one admits a request).

    Raises ``ValueError`` for a user without a password (or the reverse), or an
    empty value.
    """

    token: str | None = dataclasses.field(default=None, repr=False)
    user: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.user is None) != (self.password is None):
            raise ValueError("basic auth needs both a user and a password")
        for name, value in (
            ("token", self.token),
            ("user", self.user),
            ("password", self.password),
        ):
            if value is not None and not value.strip():
                raise ValueError(f"the dashboard's {name} is empty")
        if self.user is not None and ":" in self.user:
            raise ValueError("a basic auth user name cannot hold ':'")

    @property
    def configured(self) -> bool:
        """Whether any credential is set (else every request is admitted)."""
        return self.token is not None or self.user is not None

    def admits(self, authorization: str | None) -> bool:
        """Whether the ``Authorization`` header value carries a credential of this auth."""
        if not self.configured:
            return True
        scheme, _, value = (authorization or "").strip().partition(" ")
        value = value.strip()
        if scheme.lower() == "bearer" and self.token is not None:
            return _same(value, self.token)
        if scheme.lower() != "basic" or not value:
            return False
        try:
            user, sep, password = base64.b64decode(value, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        if not sep:
            return False
        if self.token is not None and _same(password, self.token):
            return True
        if self.user is None or self.password is None:
            return False
        # Both compared, so the time taken does not tell which one was wrong.
        return _same(user, self.user) & _same(password, self.password)

    def challenge(self) -> str:
        """The ``WWW-Authenticate`` header of a 401: basic (a browser prompts), else bearer."""
        return f'Basic realm="{REALM}", charset="UTF-8"' if self.user or self.token else "Bearer"


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


# -- CSRF ---------------------------------------------------------------------------------


def csrf_token(secret: bytes, path: str, now: float | None = None) -> str:
    """A token for a form that posts to ``path``, issued ``now`` (``time.time()``)."""
    issued = int(time.time() if now is None else now)
    return f"{issued}.{_mac(secret, issued, path)}"


def csrf_valid(secret: bytes, path: str, token: str | None, now: float | None = None) -> bool:
    """Whether ``token`` was issued by :func:`csrf_token` for ``path`` under ``secret``,
    less than :data:`CSRF_MAX_AGE` ago."""
    issued_text, _, mac = (token or "").partition(".")
    if not issued_text.isdigit() or not mac:
        return False
    issued = int(issued_text)
    age = (time.time() if now is None else now) - issued
    return 0 <= age <= CSRF_MAX_AGE and _same(mac, _mac(secret, issued, path))


def _mac(secret: bytes, issued: int, path: str) -> str:
    message = f"exactonce-csrf|{issued}|{path}".encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def same_origin(origin: str | None, referer: str | None, host: str | None) -> bool:
    """Whether a POST comes from a page of the host it was sent to.

    ``origin`` (else ``referer``) must be an ``http(s)`` URL whose host and port
    are ``host`` (the request's ``Host`` header). Neither given, or ``null``:
    refused.
    """
    source = origin if origin and origin != "null" else referer
    if not source or not host:
        return False
    parts = urlsplit(source)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False
    return _netloc(parts.netloc, parts.scheme) == _netloc(host, parts.scheme)


def _netloc(netloc: str, scheme: str) -> str:
    """``host:port`` in lower case, the scheme's default port written out."""
    netloc = netloc.rpartition("@")[2].lower()
    parts = urlsplit(f"//{netloc}")
    try:
        port = parts.port
    except ValueError:
        return netloc
    default = 443 if scheme == "https" else 80
    return f"{parts.hostname}:{port or default}"


# -- hosts --------------------------------------------------------------------------------


def is_loopback(address: str) -> bool:
    """Whether the bind ``address`` reaches this machine only (``127.0.0.1``, ``::1``,
    ``localhost``); ``0.0.0.0``, ``::`` and any other name or address do not."""
    text = address.strip().strip("[]").lower()
    if text in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(text).is_loopback
    except ValueError:
        return False


def loopback_hosts(bind: str) -> list[str]:
    """The ``Host`` names a dashboard bound to loopback without auth answers to.

    Any other name is refused: a page of another site whose name resolves to
    127.0.0.1 (DNS rebinding) cannot read the dashboard through the browser.
    """
    return sorted({"localhost", "127.0.0.1", "::1", "[::1]", bind.strip()})
