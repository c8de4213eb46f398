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


def test_a_plain_payload_is_encoded_once_as_the_stores_write_each_part() -> None:
    from celery_exactonce.core.refs import JobRef
    from celery_exactonce.core.states import State
    from celery_exactonce.core.writes import NewJob
    from celery_exactonce.stores.redis.codec import to_json

    new = NewJob(
        JobRef.submitted("p1"),
        "t.add",
        State.SCHEDULED,
        node="n",
        args=(1, "é", [None]),
        kwargs={"z": 1, "a": {"y": 2.5, "b": True}},  # kept in the caller's order
        options={"queue": "q"},
    )
    assert new.payload_json == (to_json(new.args), to_json(new.kwargs), to_json(new.options))
    assert new.payload_json[1] == '{"z":1,"a":{"y":2.5,"b":true}}'


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ([datetime(2026, 1, 2, tzinfo=timezone.utc)], {}),  # kombu types it
        ([], {"x": {"__type__": "decimal", "__value__": "2"}}),  # looks typed
        (["x" * payload.MAX_PAYLOAD_BYTES], {}),  # over the limit: refused below
    ],
)
def test_a_payload_that_is_not_plain_json_takes_the_long_way(args: list, kwargs: dict) -> None:
    assert payload.plain_parts(args, kwargs, {}) is None


def test_a_payload_that_cannot_be_stored_is_refused_naming_the_culprit() -> None:
    from celery_exactonce.core import exceptions
    from celery_exactonce.core.refs import JobRef
    from celery_exactonce.core.states import State
    from celery_exactonce.core.writes import NewJob

    def build(**kw: object) -> NewJob:
        return NewJob(JobRef.submitted("p2"), "t.add", State.SCHEDULED, node="n", **kw)  # type: ignore[arg-type]

    with pytest.raises(exceptions.InvalidPayload, match="kwargs cannot be stored as JSON"):
        build(kwargs={"f": float("nan")})
    with pytest.raises(exceptions.InvalidPayload, match="args cannot be stored as JSON"):
        build(args=[object()])
    with pytest.raises(exceptions.InvalidPayload, match="over 1048576"):
        build(args=["x" * payload.MAX_PAYLOAD_BYTES])
    typed = build(args=[Decimal("1.5")])
    assert typed.payload_json is None  # kombu-typed: the store encodes it
    assert typed.args == [{"__type__": "decimal", "__value__": "1.5"}]
