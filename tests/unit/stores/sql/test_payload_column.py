"""The SQL payload column of a create: the texts its request encoded, reused, not encoded again."""

from __future__ import annotations

import json
from decimal import Decimal

from celery_exactonce.core import jobs, times
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.stores.sql import rows


def _new(**kw: object) -> NewJob:
    given = {"args": [1, "é"], "kwargs": {"z": 1, "a": [None, 2.5]}, "options": {"queue": "q"}}
    return NewJob(JobRef.submitted("s1"), "t.add", State.SCHEDULED, node="n", **{**given, **kw})  # type: ignore[arg-type]


def test_the_payload_column_of_a_create_is_its_requests_texts_and_decodes_as_before() -> None:
    for new in (_new(), _new(signature="ab12")):
        text = rows.new_payload(new)
        assert text is not None and new.payload_json is not None
        assert new.payload_json[1] in text  # the kwargs as encoded when the request was built
        job = jobs.job_from_new(new, times.UNIX_EPOCH)
        assert json.loads(text) == rows.payload_document(job)
        assert rows.job_values(job, "ns", 1.0, payload=text)["payload"] == text


def test_a_payload_with_kombu_typed_values_is_encoded_by_the_store() -> None:
    assert rows.new_payload(_new(kwargs={"d": Decimal("1")})) is None


def test_a_create_statement_binds_no_history_column_it_writes_in_pieces() -> None:
    job = jobs.job_from_new(_new(), times.UNIX_EPOCH)
    assert "history" not in rows.job_values(job, "ns", 1.0, history=False)
    assert json.loads(rows.job_values(job, "ns", 1.0)["history"])[0]["rev"] == job.rev
