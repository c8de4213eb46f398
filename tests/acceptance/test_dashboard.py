"""The dashboard in a real headless browser, on a real worker and beat: find, filter, cancel.

On Redis and PostgreSQL stores (a Redis broker), a worker and a beat node run
the ledger app's two entries every second, and ``celery -A APP exactonce web
--actions`` serves the dashboard (a real process on a spare port,
:class:`tests.web.process.WebProcess`). The store holds a job in every state:
the entries' occurrences (``SUCCEEDED``, ``PUBLISHED``), a body still
running, one that failed, delayed jobs, and one seeded job of each state. A
person, in Chromium (:mod:`tests.support.browser`), sees every state, filters
by state and by entry, reads an entry's next slot and skipped slots, finds a
delayed job by the start of its id, opens its history and cancels it; the job
then never runs, as the ledger the worker's bodies write shows, while one
submitted beside it runs. The test asserts on the pages, not on screenshots.
"""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from celery_exactonce.core.skipped_slots import SkippedSlots
from celery_exactonce.core.states import State
from tests.acceptance.harness import APP_MODULE, Deployment, Ledger, holds, poll
from tests.support.browser import arrived, browser
from tests.web.conftest import jobs_in_every_state
from tests.web.process import WebProcess

pytest.importorskip("starlette", reason="the web extra is not installed")

pytestmark = [
    pytest.mark.usefixtures("gate"),
    pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis", "postgres")),
]

#: Seconds between the slots of the ledger app's entries (gated-every, plain-every).
EVERY = 1.0
#: The delayed jobs' countdown: long enough for the pages between submit and cancel.
COUNTDOWN = 15
#: Beat sweeps every second: "a few ticks" past the run_at.
TICKS = 3.0
#: What a page shows an instant as: to the second, UTC.
INSTANT = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ")


def sees_every_state_and_filters_by_state(page: Any, web: WebProcess, running: str) -> None:
    """The jobs page lists every state; the state filter leaves the running jobs alone."""
    from selenium.webdriver.common.by import By

    page.get(f"{web.url}/jobs?limit=1000")
    rows = page.find_elements(By.CSS_SELECTOR, "#jobs tbody tr")
    assert {row.get_attribute("data-state") for row in rows} == {s.value for s in State}
    page.get(f"{web.url}/jobs")
    page.find_element(By.CSS_SELECTOR, "input[name=state][value=RUNNING]").click()
    page.find_element(By.CSS_SELECTOR, "#filters button[type=submit]").click()
    arrived(page, "state=RUNNING")
    rows = page.find_elements(By.CSS_SELECTOR, "#jobs tbody tr")
    assert {row.get_attribute("data-state") for row in rows} == {"RUNNING"}
    assert running in page.find_element(By.ID, "jobs").text


def reads_an_entry_and_filters_by_it(page: Any) -> None:
    """The entries page shows gated-every's next slot, last claimed slot and outcome, and
    skipped slots; its link filters the jobs by it."""
    from selenium.webdriver.common.by import By

    page.find_element(By.LINK_TEXT, "Entries").click()
    arrived(page, "/entries")
    entry = page.find_element(By.CSS_SELECTOR, '#entries tr[data-entry="gated-every"]')
    assert INSTANT.search(entry.find_element(By.CSS_SELECTOR, "td.next").text)
    assert INSTANT.search(entry.find_elements(By.TAG_NAME, "td")[4].text)  # last claimed
    assert "SUCCEEDED" in entry.find_element(By.CSS_SELECTOR, "td.outcome").text
    assert "3 catchup" in entry.find_element(By.CSS_SELECTOR, "td.skipped").text
    assert "gated-every catchup 3" in page.find_element(By.ID, "skipped").text
    entry.find_element(By.LINK_TEXT, "gated-every").click()
    arrived(page, "entry=gated-every")
    rows = page.find_elements(By.CSS_SELECTOR, "#jobs tbody tr")
    assert rows
    assert {row.find_elements(By.TAG_NAME, "td")[3].text for row in rows} == {"gated-every"}


def finds_and_cancels(page: Any, victim: str) -> None:
    """The find box takes the start of the id to the job; its history; its cancel button."""
    from selenium.webdriver.common.by import By

    find = page.find_element(By.ID, "find")
    find.send_keys(victim[:8])
    find.submit()
    arrived(page, f"id={victim}")
    assert page.find_element(By.ID, "state").text == "PENDING"
    assert "(new) PENDING" in page.find_element(By.ID, "history-1").text
    page.find_element(By.ID, "cancel").click()
    arrived(page, "/actions/cancel")
    assert page.find_element(By.ID, "outcome").text == f"cancelled {victim}: it will not run"
    page.find_element(By.ID, "back").click()
    arrived(page, f"id={victim}")
    assert page.find_element(By.ID, "state").text == "CANCELLED"
    assert not page.find_elements(By.ID, "cancel")


@pytest.mark.timeout(170)
def test_a_person_finds_filters_and_cancels_jobs_in_the_dashboard(
    deployment: Deployment, ledger: Ledger, tmp_path: Path
) -> None:
    # Given a worker, a beat node running two entries every second, and the dashboard
    worker = deployment.start_worker(concurrency=2, wait=False)
    beat = deployment.start_beat(every=EVERY, wait=False)
    env = {**deployment.env, "EXACTONCE_ACC_BEAT_EVERY": str(EVERY)}  # beat's entries
    web = WebProcess(APP_MODULE, env, tmp_path / "web.log", ["--actions"]).start()
    try:
        worker.wait_ready()
        beat.wait_ready()
        web.wait_ready()
        # ... with a job in every state: a body running, one failed, the entries' occurrences
        running = deployment.send("gated_slow", 60)
        failed = deployment.send("gated_failing", "boom")
        poll(lambda: deployment.job_state(running.id) is State.RUNNING, timeout=30)
        poll(lambda: deployment.job_state(failed.id) is State.FAILED, timeout=30)
        poll(lambda: ledger.count(task="gated_record") >= 2, timeout=30)
        # ... one seeded job of each state, and a range of skipped slots of an entry
        store = deployment.store()
        jobs_in_every_state(store, "seeded")
        first = store.now().replace(microsecond=0) - timedelta(hours=1)
        skipped = SkippedSlots(
            "gated-every", "catchup", first, first + timedelta(seconds=2), 3, "n"
        )
        store.note_skipped([skipped])
        with browser() as page:
            # When a person looks at the jobs and the entries, filtering as they go
            sees_every_state_and_filters_by_state(page, web, running.id)
            reads_an_entry_and_filters_by_it(page)
            # ... and a delayed job is submitted (and one beside it nobody cancels),
            # which they find by the start of its id and cancel
            victim = deployment.send("gated_record", "victim", countdown=COUNTDOWN)
            control = deployment.send("gated_record", "control", countdown=COUNTDOWN)
            assert deployment.job_state(victim.id) is State.PENDING
            finds_and_cancels(page, victim.id)
        # Then it never runs: the one beside it runs once its run_at came
        ledger.wait_count(1, task_id=control.id, timeout=COUNTDOWN + 30)
        holds(lambda: ledger.count(task_id=victim.id) == 0, seconds=TICKS)
        job = deployment.record(victim.id)
        assert job.state is State.CANCELLED and job.dispatches == 0
        assert [h.dst for h in job.history] == [State.PENDING, State.CANCELLED]
    finally:
        web.stop()
    assert "Traceback" not in web.log(), web.log()
