"""Idempotency keys: the deterministic name of one scheduled occurrence.

``idempotency_key(key, fire_time, namespace)`` is what task code passes to an
email provider, a payment API or its own unique index so that its *effects*
happen once even when the task body runs again (after an opted-in re-run, or
in another system). It must be byte-identical on every node, every Python
version and every ``PYTHONHASHSEED``, so it is defined on bytes only:

    v1 = "eo1_" + hex(SHA-256(
        lp(b"celery-exactonce/idempotency/1")
        + lp(utf8(namespace)) + lp(utf8(key)) + lp(ascii(utc_instant))
    ))

where ``lp(b)`` is the 4-byte big-endian length of ``b`` followed by ``b``
(length prefixes make ``("a-b", "c")`` and ``("a", "b-c")`` distinct whatever
the separators) and ``utc_instant`` is the fire time in UTC as
``YYYY-MM-DDTHH:MM:SS.ffffffZ`` (always six fractional digits). The ``eo1_``
prefix names the format version; a future format gets a new prefix and the
golden vectors in ``tests/unit/core/test_keys.py`` pin this one.
"""

from __future__ import annotations

import functools
import hashlib
from datetime import datetime, timezone

from celery_exactonce.core import exceptions
from celery_exactonce.core.refs import JobRef

#: Version tag of the key format, part of both the hashed bytes and the prefix.
KEY_FORMAT_VERSION = 1
_DOMAIN = b"celery-exactonce/idempotency/1"
_PREFIX = "eo1_"


def _length_prefixed(*fields: bytes) -> bytes:
    return b"".join(len(field).to_bytes(4, "big") + field for field in fields)


def canonical_instant(fire_time: datetime) -> str:
    """``fire_time`` as a canonical UTC string; naive datetimes are refused.

    Raises
    ------
    InvalidPayload
        ``fire_time`` is not a datetime, or is naive (a naive time names a
        different instant on nodes in different time zones).
    """
    if not isinstance(fire_time, datetime):
        raise exceptions.InvalidPayload(
            f"fire_time must be a datetime, got {type(fire_time).__name__}"
        )
    if fire_time.tzinfo is None or fire_time.utcoffset() is None:
        raise exceptions.InvalidPayload(
            f"fire_time must be timezone-aware, got naive {fire_time.isoformat()}"
        )
    return _utc_text(fire_time)


@functools.lru_cache(maxsize=16_384)
def _utc_text(fire_time: datetime) -> str:
    """The canonical text of a checked ``fire_time``, remembered (an ad-hoc job's is always
    the epoch's; beat derives a slot's more than once)."""
    utc = fire_time.astimezone(timezone.utc)
    if utc.year < 1000:  # strftime's %Y does not pad such a year everywhere; keep its form
        return utc.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return utc.replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"  # the same, faster


def idempotency_key(key: str, fire_time: datetime, namespace: str = "default") -> str:
    """The idempotency key of occurrence ``(key, fire_time)`` in ``namespace``.

    Parameters
    ----------
    key:
        The occurrence key: the beat entry's name, or any string that names a
        recurring unit of work. Any characters, separators included.
    fire_time:
        The nominal slot, timezone-aware; only the UTC instant counts.
    namespace:
        The ``exactonce_namespace`` of the app.

    Returns
    -------
    str
        ``"eo1_"`` followed by 64 lowercase hex digits.

    Raises
    ------
    InvalidPayload
        ``key`` or ``namespace`` is not a string or is empty, or ``fire_time``
        is naive.
    """
    for name, value in (("key", key), ("namespace", namespace)):
        if not isinstance(value, str) or not value:
            raise exceptions.InvalidPayload(f"{name} must be a non-empty string, got {value!r}")
    return _digest(key, canonical_instant(fire_time), namespace)


@functools.lru_cache(maxsize=16_384)
def _digest(key: str, instant: str, namespace: str) -> str:
    """The key of a validated occurrence, remembered: beat derives each one when it
    plans the slot and again when it publishes the claim (a whole slot of entries
    may come between the two)."""
    return digest(key, instant, namespace)


def digest(key: str, instant: str, namespace: str) -> str:
    """:func:`idempotency_key` of a non-empty ``key`` and ``namespace`` and a canonical
    ``instant`` (:func:`canonical_instant`), not remembered: a key derived once (a
    submitted job's, whose id is new each time) would only push others out."""
    space, name, at = namespace.encode("utf-8"), key.encode("utf-8"), instant.encode("ascii")
    data = b"".join(  # _length_prefixed(_DOMAIN, space, name, at), spelt out: every submit
        (
            _DOMAIN_PREFIXED,
            len(space).to_bytes(4, "big"),
            space,
            len(name).to_bytes(4, "big"),
            name,
            len(at).to_bytes(4, "big"),
            at,
        )
    )
    return _PREFIX + hashlib.sha256(data).hexdigest()


_DOMAIN_PREFIXED = _length_prefixed(_DOMAIN)


def occurrence_ref(namespace: str, entry: str, fire_time: datetime) -> JobRef:
    """The ref of ``entry``'s occurrence at ``fire_time``: its id is its idempotency key."""
    return JobRef.occurrence(idempotency_key(entry, fire_time, namespace), entry)
