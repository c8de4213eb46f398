"""The dashboard's pages on every store (memory, Redis, PostgreSQL, MySQL, SQLite): what each shows.

Every page is read through Starlette's test client on
:func:`celery_exactonce.web.create_app`, on a namespace holding a job in
every state, an occurrence of a beat entry and its skipped slots
(:class:`tests.web.conftest.Site`).
"""

from __future__ import annotations

import re
from datetime import timedelta

import pytest

from celery_exactonce.beat.entries import occurrence_id
from celery_exactonce.core import keys
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.dispatch import messages
from tests.support.helpers import NODE, move
from tests.web.conftest import FIRE, NIGHTLY, Site, form_of

pytestmark = pytest.mark.timeout(60)

#: An instant as the pages show it: to the second, UTC.
INSTANT = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ")


def ids_on(page: str) -> list[str]:
    """The task ids the jobs table lists, in order."""
    return re.findall(r'<td class="id"><a href="[^"]*">([^<]+)</a></td>', page)


def test_the_jobs_page_lists_a_job_in_every_state_ids_whole_times_to_the_second(
    site: Site,
) -> None:
    # Given a store with a job in every state and a beat occurrence
    client = site.client()
    # When the jobs page is opened (the dashboard's front page leads there)
    page = client.get("/")
    # Then it lists each of them, in state order, its whole id
    assert page.status_code == 200
    assert str(page.url).endswith("/jobs")
    listed = ids_on(page.text)
    assert set(listed) == {f"job-{s.value.lower()}" for s in State} | {site.occurrence.id}
    order = [s.value for s in State]
    states = re.findall(r'<tr data-state="(\w+)">', page.text)
    assert states == sorted(states, key=order.index)
    assert len(site.occurrence.id) > 60 and site.occurrence.id in listed  # never cut
    # ... and its times to the second, in UTC
    touched = site.jobs[State.RUNNING].touched_at.strftime("%Y-%m-%d %H:%M:%SZ")
    assert touched in page.text
    assert not re.search(r"\d\d:\d\d:\d\d\.\d", page.text)


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("state=RUNNING", {"job-running"}),
        ("state=running&state=failed", {"job-running", "job-failed"}),
        ("task=web.succeeded", {"job-succeeded"}),
        (f"entry={NIGHTLY}", {"occurrence"}),
        ("state=PENDING&older_than=1h", set()),
        ("older_than=0s&state=CANCELLED", {"job-cancelled"}),
    ],
)
def test_the_jobs_page_filters_by_state_task_entry_and_age(
    site: Site, query: str, expected: set[str]
) -> None:
    page = site.client().get(f"/jobs?{query}")
    assert page.status_code == 200, page.text
    wanted = {site.occurrence.id if e == "occurrence" else e for e in expected}
    assert set(ids_on(page.text)) == wanted


def test_the_jobs_page_pages_with_a_cursor_and_lists_each_job_once(site: Site) -> None:
    client = site.client()
    seen: list[str] = []
    page = client.get("/jobs?limit=3")
    for _ in range(10):
        seen += ids_on(page.text)
        following = re.search(r'<a id="next" href="([^"]+)"', page.text)
        if following is None:
            break
        page = client.get(following.group(1).replace("&amp;", "&"))
        assert page.status_code == 200
    assert len(seen) == len(State) + 1
    assert len(set(seen)) == len(seen)


def test_a_job_is_found_by_its_id_or_the_start_of_it(site: Site) -> None:
    client = site.client()
    # An id goes to its job, and so does the start of one id
    for given in ("job-running", "job-runn", site.occurrence.id[:12]):
        page = client.get("/jobs", params={"id": given})
        assert page.status_code == 200, given
        assert "/job?id=" in str(page.url)
        wanted = site.occurrence.id if given == site.occurrence.id[:12] else "job-running"
        assert f"Job <code>{wanted}</code>" in page.text
    # The start of several ids lists them, each a link to its job
    page = client.get("/jobs", params={"id": "job-"})
    assert page.status_code == 200
    matches = re.findall(r'<a class="id" href="[^"]*">([^<]+)</a>', page.text)
    assert set(matches) == {f"job-{s.value.lower()}" for s in State}
    assert "More than one job" in page.text
    # ... as does the page of a job given the start of several ids
    page = client.get("/job", params={"id": "job-"})
    assert page.status_code == 200 and "More than one job" in page.text
    # ... and the start of none is a 404 page saying so
    page = client.get("/jobs", params={"id": "nobody"})
    assert page.status_code == 404
    assert "no job whose id is or starts with" in page.text


def test_a_job_page_shows_every_field_its_key_and_its_history_with_reasons(site: Site) -> None:
    job = site.jobs[State.SUCCEEDED]
    page = site.client().get("/job", params={"id": "job-succeeded"})
    assert page.status_code == 200
    text = page.text
    assert 'id="state">SUCCEEDED<' in text
    assert messages.job_idempotency_key(job, site.namespace) in text
    assert job.rev in text and job.run_id is not None and job.run_id in text
    history = text[text.index('id="history-1"') :]
    rows = re.findall(r"<tr><td>([^<]+)</td><td[^>]*>([^<]+)</td><td[^>]*>([^<]+)</td>", history)
    assert [(src, dst) for _, src, dst in rows] == [
        ("(new)", "SCHEDULED"),
        ("SCHEDULED", "DISPATCHED"),
        ("DISPATCHED", "RUNNING"),
        ("RUNNING", "SUCCEEDED"),
    ]
    assert history.count("<td>test</td>") == 3  # each transition's reason
    # An occurrence shows its entry, its slot and its idempotency key (entry, slot, namespace)
    page = site.client().get("/job", params={"id": site.occurrence.id})
    assert keys.idempotency_key(NIGHTLY, FIRE, site.namespace) in page.text
    assert "2026-05-01 03:00:00Z" in page.text and NIGHTLY in page.text


def test_the_entries_page_shows_next_slots_last_claimed_and_skipped_slots(site: Site) -> None:
    page = site.client().get("/entries")
    assert page.status_code == 200
    row = page.text[page.text.index(f'<tr data-entry="{NIGHTLY}">') :].split("</tr>")[0]
    now = site.store.now()
    nxt = now.replace(hour=3, minute=0, second=0, microsecond=0)
    if nxt <= now:
        nxt += timedelta(days=1)
    assert nxt.strftime("%Y-%m-%d %H:%M:%SZ") in row  # the next slot
    assert "2026-05-01 03:00:00Z" in row  # the last claimed
    assert ">DISPATCHED</a>" in row and site.occurrence.id in row
    assert "3 catchup" in row
    skipped = page.text[page.text.index('id="skipped"') :]
    assert "2026-04-28 03:00:00Z" in skipped and "2026-04-30 03:00:00Z" in skipped


def test_the_health_page_shows_the_store_epoch_counts_backlog_and_lease(site: Site) -> None:
    page = site.client().get("/health")
    assert page.status_code == 200
    text = page.text
    assert site.namespace in text
    assert site.store.epoch() in text
    counts = re.findall(r"<td><a href=\"[^\"]*\">(\d+)</a></td>", text)
    assert counts == ["1", "1", "2", "1", "1", "1", "1", "1", "1"]  # DISPATCHED: 1 + nightly
    assert 'id="backlog">0' in text
    assert "(free)" in text  # nobody holds the reconciler's lease
    assert "job-pending" in text  # the oldest PENDING job (the lag)


def test_a_stored_entry_is_paused_and_resumed_from_the_entries_page(site: Site) -> None:
    from celery_exactonce import entries

    # Given an entry stored at run time, and the dashboard with its actions
    options = {"exactonce": {"gated": False}}
    entries.save(site.app, "stored-report", "web.report", "*/5 * * * *", options=options)
    client = site.client(actions=True)
    origin = {"Origin": "http://testserver"}
    page = client.get("/entries")
    row = page.text[page.text.index('<tr data-entry="stored-report">') :].split("</tr>")[0]
    assert INSTANT.search(row.split('class="next"')[1])  # its next slot
    # ... (beat_schedule's entries have no button: only stored ones pause)
    nightly = page.text[page.text.index(f'<tr data-entry="{NIGHTLY}">') :].split("</tr>")[0]
    assert "/actions/pause" not in nightly
    # When it is paused from its row
    done = client.post("/actions/pause", data=form_of(row, "/actions/pause"), headers=origin)
    # Then it is paused in the store, and the page shows it so, with no next slot
    assert done.status_code == 200 and "paused stored-report" in done.text
    stored = entries.get(site.app, "stored-report")
    assert stored is not None and stored.paused
    page = client.get("/entries")
    row = page.text[page.text.index('<tr data-entry="stored-report">') :].split("</tr>")[0]
    assert "PAUSED" in row and not INSTANT.search(row.split('class="next"')[1])
    # And resumed, it runs again
    done = client.post("/actions/resume", data=form_of(row, "/actions/resume"), headers=origin)
    assert done.status_code == 200 and "resumed stored-report" in done.text
    stored = entries.get(site.app, "stored-report")
    assert stored is not None and not stored.paused
    # ... while an entry that is not stored is a 404 page, with nothing changed
    page = client.get("/entries")
    form = {**form_of(page.text, "/actions/pause"), "entry": "nobody"}
    assert client.post("/actions/pause", data=form, headers=origin).status_code == 404


def test_an_entrys_last_outcome_is_its_newest_occurrence_that_ended(site: Site) -> None:
    # Given the entry's slot at FIRE ended SUCCEEDED, and the next one dispatched, not ended
    fired = site.store.get(site.occurrence)
    assert fired is not None
    for state in (State.RUNNING, State.SUCCEEDED):
        fired = move(site.store, fired, state)
    after = FIRE + timedelta(days=1)
    ref = JobRef.occurrence(occurrence_id(site.namespace, NIGHTLY, after))
    new = NewJob(ref, "web.bill", State.SCHEDULED, node=NODE, entry=NIGHTLY, fire_time=after)
    made = site.store.create(new).job
    assert made is not None
    move(site.store, made, State.DISPATCHED)
    # When the entries page is read
    page = site.client().get("/entries")
    row = page.text[page.text.index(f'<tr data-entry="{NIGHTLY}">') :].split("</tr>")[0]
    # Then the last claimed is the dispatched one, and the last outcome the one that ended
    assert "2026-05-02 03:00:00Z" in row and ">DISPATCHED</a>" in row
    outcome = row.split('class="outcome"')[1].split("</td>")[0]
    assert ">SUCCEEDED</a>" in outcome and "slot 2026-05-01 03:00:00Z" in outcome
    assert site.occurrence.id in outcome
