"""A stand-in for a payment provider that honours idempotency keys, as real ones do.

A charge sent again with a key it has seen is not charged again: the provider
answers with the first charge. ``CHARGES`` is what was charged, by key.
"""

from __future__ import annotations

import threading

CHARGES: dict[str, tuple[str, int]] = {}
#: Every call the provider received (a retried call counts once per call).
CALLS: list[str] = []
_LOCK = threading.Lock()


class Declined(Exception):
    """The provider refused the charge for now (a retry may pass)."""


def charge(order_id: str, cents: int, *, idempotency_key: str) -> tuple[str, int]:
    """Charge ``cents`` for ``order_id`` once per ``idempotency_key``."""
    with _LOCK:
        CALLS.append(idempotency_key)
        return CHARGES.setdefault(idempotency_key, (order_id, cents))
