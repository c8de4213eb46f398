"""idempotency_key: golden vectors, canonical encoding, and stability across processes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest

from celery_exactonce import InvalidPayload, idempotency_key

UTC = timezone.utc

#: Pinned forever for format v1: a change here is a breaking change of the key format.
GOLDEN = [
    (("report", datetime(2026, 1, 1, tzinfo=UTC), "default"),
     "eo1_c790b65c3bdea14bbe07a8399a4bb8791718b4b91b7060e8efa2dec0ac4c2940"),
    (("report", datetime(2026, 3, 29, 1, 0, tzinfo=UTC), "prod"),
     "eo1_1ce49b0b1528554018b2a35d593bb61f602791139e1b79c352ae4c4e7546291e"),
    (("a:b", datetime(2026, 3, 29, 3, 0, tzinfo=timezone(timedelta(hours=2))), "a-b"),
     "eo1_52670fb8dc8ce889be4bc2d2b13e4b9735a7028c44dcfc628fb82852a8adfbe2"),
    (("b-c", datetime(2026, 3, 29, 1, 0, tzinfo=UTC), "a"),
     "eo1_7a45e682c20907fbbdb3c24103a3ad757142c88557af9266e542fdd7536ac511"),
    (("c", datetime(2026, 3, 29, 1, 0, tzinfo=UTC), "a-b"),
     "eo1_ebe9fe511ac98afe4b1880f6cab13ed7f852cf9db625f912edfac0a14d17a132"),
    (("ü", datetime(2026, 3, 29, 1, 0, 0, 123456, tzinfo=UTC), "default"),
     "eo1_1a94a3a68cd5a4d0adf8c9721926121ae362849389ee096651976f1d0de2f1e0"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "expected"), GOLDEN)
def test_golden_vectors(args: tuple[str, datetime, str], expected: str) -> None:
    key, fire_time, namespace = args
    assert idempotency_key(key, fire_time, namespace) == expected


def test_matches_the_documented_encoding() -> None:
    # Recompute the first vector from the format's definition, independently of the code
    def lp(data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + data

    data = (
        lp(b"celery-exactonce/idempotency/1")
        + lp(b"default")
        + lp(b"report")
        + lp(b"2026-01-01T00:00:00.000000Z")
    )
    assert GOLDEN[0][1] == "eo1_" + hashlib.sha256(data).hexdigest()


def test_only_the_utc_instant_counts() -> None:
    instant = datetime(2026, 10, 25, 0, 30, tzinfo=UTC)
    berlin = instant.astimezone(ZoneInfo("Europe/Berlin"))
    new_york = instant.astimezone(ZoneInfo("America/New_York"))
    keys = {idempotency_key("k", t) for t in (instant, berlin, new_york)}
    assert len(keys) == 1


def test_separators_cannot_collide() -> None:
    fire = datetime(2026, 1, 1, tzinfo=UTC)
    assert idempotency_key("c", fire, "a-b") != idempotency_key("b-c", fire, "a")
    assert idempotency_key("b:c", fire, "a") != idempotency_key("c", fire, "a:b")
    assert idempotency_key("x", fire) != idempotency_key("x", fire + timedelta(microseconds=1))


def test_naive_and_bad_inputs_are_refused() -> None:
    with pytest.raises(InvalidPayload, match="timezone-aware"):
        idempotency_key("k", datetime(2026, 1, 1))
    with pytest.raises(InvalidPayload, match="key"):
        idempotency_key("", datetime(2026, 1, 1, tzinfo=UTC))
    with pytest.raises(InvalidPayload, match="namespace"):
        idempotency_key("k", datetime(2026, 1, 1, tzinfo=UTC), namespace=None)  # type: ignore[arg-type]
    with pytest.raises(InvalidPayload, match="datetime"):
        idempotency_key("k", "2026-01-01")  # type: ignore[arg-type]


def test_identical_across_processes_with_different_hash_seeds() -> None:
    code = (
        "from datetime import datetime, timezone; from celery_exactonce import idempotency_key;"
        "print(idempotency_key('report', datetime(2026, 1, 1, tzinfo=timezone.utc)),"
        " idempotency_key('ü:x', datetime(2026, 3, 29, 1, tzinfo=timezone.utc), 'a-b'))"
    )
    outputs = set()
    for seed in ("0", "1", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        outputs.add(out)
    assert len(outputs) == 1
    assert outputs.pop().split()[0] == GOLDEN[0][1]


def test_a_submitted_jobs_key_unremembered_is_the_key_idempotency_key_derives() -> None:
    from celery_exactonce.core import exceptions, keys, times
    from celery_exactonce.dispatch import messages

    for task_id, namespace in (("a1", "default"), ("é/x:y", "ns")):
        expected = keys.idempotency_key(f"job:{task_id}", times.UNIX_EPOCH, namespace)
        assert messages.submitted_key(task_id, namespace) == expected
        assert keys.digest(f"job:{task_id}", "1970-01-01T00:00:00.000000Z", namespace) == expected
    with pytest.raises(exceptions.InvalidPayload, match="namespace"):
        messages.submitted_key("a1", "")
