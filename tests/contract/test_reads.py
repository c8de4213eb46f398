"""The reads for people (the CLI): filtered listings, a lease's holder (counts: test_counts)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from celery_exactonce.core.exceptions import InvalidPayload
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.stores.base import StateStore, format_written
from celery_exactonce.stores.redis import reads as redis_reads
from tests.support.helpers import occurrence, poll, task_job, to, wait_store_past

UTC = timezone.utc


@pytest.fixture
def small_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Filtered listings that read few records a page (Redis), so paging is exercised."""
    monkeypatch.setattr(redis_reads, "FILTER_PAGE", 2)


@pytest.fixture
def small_scans(monkeypatch: pytest.MonkeyPatch) -> None:
    """Index scans of few members a step (Redis), so ``find_ids`` walks several."""
    monkeypatch.setattr(redis_reads, "SCAN_COUNT", 1)


@pytest.mark.usefixtures("small_pages")
def test_list_jobs_filters_by_task_and_entry_and_pages_on(store: StateStore) -> None:
    made = []
    fire = datetime(2026, 5, 1, 3, tzinfo=UTC)
    for i in range(7):
        new = (
            occurrence("nightly", fire + timedelta(minutes=i), task="tasks.bill")
            if i % 2
            else task_job(f"j{i}", task="tasks.add" if i % 3 else "tasks.bill")
        )
        result = store.create(new)
        assert result.job is not None
        made.append(result.job)
        wait_store_past(store, result.job.touched_at)  # distinct touch times: a fixed order
    every = store.list_jobs(State.SCHEDULED, 100)
    assert [job.ref for job in every] == [job.ref for job in made]
    bills = [job.ref for job in made if job.task == "tasks.bill"]
    assert [job.ref for job in store.list_jobs(State.SCHEDULED, 100, task="tasks.bill")] == bills
    nightly = [job.ref for job in made if job.entry == "nightly"]
    assert [job.ref for job in store.list_jobs(State.SCHEDULED, 100, entry="nightly")] == nightly
    assert store.list_jobs(State.SCHEDULED, 100, task="tasks.add", entry="nightly") == []
    assert store.list_jobs(State.SCHEDULED, 100, task="nope") == []
    assert store.list_jobs(State.RUNNING, 100) == []
    assert store.list_jobs(State.SCHEDULED, 0, task="tasks.bill") == []
    # Pages of 2 from the last job of the previous page: each match once, in order.
    pages, cursor = [], None
    while True:
        page = store.list_jobs(State.SCHEDULED, 2, after=cursor, task="tasks.bill")
        pages.append([job.ref for job in page])
        if len(page) < 2:
            break
        cursor = (page[-1].touched_at, page[-1].ref)
    assert [ref for page in pages for ref in page] == bills
    assert all(len(page) == 2 for page in pages[:-1])


def test_list_jobs_by_age(store: StateStore) -> None:
    old = store.create(task_job("old")).job
    assert old is not None
    wait_store_past(store, old.touched_at + timedelta(seconds=0.3))
    store.create(task_job("new"))
    aged = store.list_jobs(State.SCHEDULED, 10, older_than=0.3)
    assert [job.ref for job in aged] == [old.ref]
    assert len(store.list_jobs(State.SCHEDULED, 10)) == 2


def test_lease_names_its_holder_until_released_or_expired(store: StateStore) -> None:
    assert store.lease("recon") is None
    before = store.now()
    assert store.acquire_lease("recon", "holder-1", 30)
    held = store.lease("recon")
    assert held is not None
    token, until = held
    assert token == "holder-1"
    assert before + timedelta(seconds=29) <= until <= store.now() + timedelta(seconds=30)
    assert store.lease("other") is None
    assert store.release_lease("recon", "holder-1")
    assert store.lease("recon") is None
    assert store.acquire_lease("recon", "holder-2", 0.2)
    poll(lambda: store.lease("recon") is None, timeout=5)


def test_schema_version_reads_what_setup_wrote(store: StateStore) -> None:
    assert store.schema_version() == format_written(store)
    store.setup()  # idempotent
    assert store.schema_version() == format_written(store)


@pytest.mark.usefixtures("small_scans")
def test_find_ids_gives_the_refs_an_id_prefix_matches_in_both_key_spaces(
    store: StateStore,
) -> None:
    """Ids by prefix, for ``show`` and ``cancel``: both key spaces, ``str(ref)`` order, bounded.

    Before the fix the store had no such read, so the CLI could not take a
    prefix of an id it had printed cut short.
    """
    fire = datetime(2026, 5, 1, 3, tzinfo=UTC)
    for job_id in ("ab*c-1", "ab*c-2", "ab?x", "abd", "zz"):
        store.create(task_job(job_id))
    beat = occurrence("ab*c", fire)
    store.create(beat)
    other = occurrence("ab*c", fire + timedelta(hours=1))
    store.create(other)
    created = store.get(JobRef.submitted("ab*c-1"))
    assert created is not None
    assert store.transition(created.ref, to(State.CANCELLED, State.SCHEDULED)).applied

    # Glob and LIKE characters in a prefix are themselves, not patterns
    assert store.find_ids("ab*c-", 10) == [JobRef.submitted("ab*c-1"), JobRef.submitted("ab*c-2")]
    assert store.find_ids("ab*c", 10) == sorted(
        [beat.ref, other.ref, JobRef.submitted("ab*c-1"), JobRef.submitted("ab*c-2")], key=str
    )
    assert store.find_ids("ab*c", 2) == sorted([beat.ref, other.ref], key=str)  # o: before t:
    assert store.find_ids("ab?", 10) == [JobRef.submitted("ab?x")]
    assert store.find_ids("ab%", 10) == [] and store.find_ids("ab_", 10) == []
    assert store.find_ids("zz", 10) == [JobRef.submitted("zz")]  # the whole id is a prefix
    assert store.find_ids("q", 10) == []
    with pytest.raises(InvalidPayload, match="job id prefix"):
        store.find_ids("", 10)
