"""Format versions: a newer record or message is refused with one line naming both versions."""

from __future__ import annotations

import pytest

from celery_exactonce.core import formats
from celery_exactonce.core.exceptions import FormatTooNew, SchemaMismatch
from celery_exactonce.stores.redis.codec import decode_job, record_fields
from tests.support.helpers import task_job


def test_an_absent_format_is_one_and_a_newer_one_is_refused_naming_both() -> None:
    assert formats.format_of(None) == formats.format_of("") == 1
    formats.refuse_newer("record", None, "job t:a")
    formats.refuse_newer("record", str(formats.RECORD_FORMAT), "job t:a")
    with pytest.raises(FormatTooNew) as refused:
        formats.refuse_newer("message", formats.MESSAGE_FORMAT + 1, "the message of job t:a")
    assert str(refused.value) == (
        f"the message of job t:a is a message of format {formats.MESSAGE_FORMAT + 1}; this "
        f"celery-exactonce reads message formats up to {formats.MESSAGE_FORMAT}: upgrade it "
        "(workers first, then beats)"
    )
    assert isinstance(refused.value, SchemaMismatch)  # a store error: callers fail closed


def test_a_redis_record_names_its_format_and_a_newer_one_is_not_decoded() -> None:
    new = task_job("a")
    fields = record_fields(new, "SCHEDULED", new.rev, new.node, new.reason)
    assert fields[:4] == ["ref", "t:a", "format", formats.RECORD_FORMAT]  # ref first (enqueue.lua)
    flat = [str(v) for v in fields] + ["attempt", "0", "created_at", "0", "touched_at", "0"]
    flat += ["dispatches", "0", "history", "[]"]
    assert decode_job(flat).ref == new.ref
    newer = [*flat[:2], "format", str(formats.RECORD_FORMAT + 1), *flat[4:]]
    with pytest.raises(FormatTooNew, match="job t:a is a record of format 2"):
        decode_job(newer)
