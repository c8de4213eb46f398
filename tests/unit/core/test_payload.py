"""``core/payload.py``: what is stored decodes to what was submitted, shortcuts too."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from decimal import Decimal

import pytest

from celery_exactonce.core import payload


@pytest.mark.parametrize(
    "value",
    [
        {"a": 1, "b": "x", "c": None},
        [1, "x", 2.5, True],
        {"when": datetime(2026, 1, 2, tzinfo=timezone.utc), "n": 1},
        [{"id": uuid.UUID(int=7)}, Decimal("1.5")],
    ],
)
def test_a_stored_payload_decodes_to_what_was_submitted(value: object) -> None:
    stored = payload.storable_payload({"args": [value]}, context="t")
    assert payload.decode_payload(stored["args"][0]) == value


def test_a_flat_payload_decodes_to_itself() -> None:
    flat = {"a": 1, "b": "x"}
    assert payload.decode_payload(flat) is flat
    typed = {"__type__": "decimal", "__value__": "2"}
    assert payload.decode_payload(typed) == Decimal("2")
