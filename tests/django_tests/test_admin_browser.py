"""The admin in a real headless browser: log in, list the jobs, filter, open a job.

Chromium and its driver are Debian's (``chromium``, ``chromium-driver``;
``.ci/run`` installs them), driven by Selenium (:mod:`tests.support.browser`),
against pytest-django's live server. Without them the test is skipped (failed
under ``EXACTONCE_REQUIRE_SERVICES``), as a test without its server is.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from celery_exactonce.stores.base import StateStore
from tests.django_tests.test_admin import jobs_in_every_state
from tests.support.browser import arrived
from tests.support.browser import browser as headless


@pytest.fixture
def browser() -> Iterator[Any]:
    with headless() as driver:
        yield driver


def test_an_operator_lists_filters_and_opens_jobs_in_a_browser(
    alias: str, live_server: Any, browser: Any, store: StateStore
) -> None:
    from django.contrib.auth.models import User
    from selenium.webdriver.common.by import By

    made = jobs_in_every_state(store)
    User.objects.create_superuser("operator", "op@example.com", "s3cret-pw")
    # Given an operator who logs in through the admin's form
    browser.get(f"{live_server.url}/admin/login/?next=/admin/celery_exactonce/job/")
    browser.find_element(By.NAME, "username").send_keys("operator")
    browser.find_element(By.NAME, "password").send_keys("s3cret-pw")
    browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    arrived(browser, "/admin/celery_exactonce/job/")
    # Then the job list shows a job in every state
    rows = browser.find_elements(By.CSS_SELECTOR, "#result_list tbody tr")
    assert len(rows) == len(made) + 1  # and the beat occurrence
    listed = browser.find_element(By.ID, "result_list").text
    for state in made:
        assert state.value in listed
    # When the operator filters by state, then by age
    browser.find_element(By.LINK_TEXT, "RUNNING").click()
    arrived(browser, "state=RUNNING")
    rows = browser.find_elements(By.CSS_SELECTOR, "#result_list tbody tr")
    assert [r.text.split()[0] for r in rows] == ["job-running"]
    browser.find_element(By.LINK_TEXT, "in the last hour").click()
    arrived(browser, "age=hour")
    assert "job-running" in browser.find_element(By.ID, "result_list").text
    # And opens the job: its record, its idempotency key and its history, read-only
    browser.find_element(By.LINK_TEXT, "job-running").click()
    arrived(browser, "/change/")
    page = browser.find_element(By.ID, "content").text
    assert "RUNNING" in page and "idempotency key" in page.lower()
    assert "SCHEDULED → DISPATCHED" in page or "SCHEDULED →" in page
    assert not browser.find_elements(By.NAME, "_save")


def test_scenario_79_the_periodic_tasks_page_opens_with_the_scheduler_alias(
    alias: str, live_server: Any, browser: Any, settings: Any
) -> None:
    """SCENARIOS 79: ``CELERY_BEAT_SCHEDULER = "exactonce-django"``, as the how-to writes it.

    Before the fix, django-celery-beat's "Periodic tasks" page answered
    HTTP 500 (Server Error) with that setting: it imported the alias as a module.
    """
    from django.contrib.auth.models import User
    from django_celery_beat.models import IntervalSchedule, PeriodicTask
    from selenium.webdriver.common.by import By

    settings.CELERY_BEAT_SCHEDULER = "exactonce-django"
    every = IntervalSchedule.objects.create(every=10, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(name="nightly-report", task="tasks.report", interval=every)
    User.objects.create_superuser("operator", "op@example.com", "s3cret-pw")
    # Given an operator logged in, who opens the periodic tasks
    target = "/admin/django_celery_beat/periodictask/"
    browser.get(f"{live_server.url}/admin/login/?next={target}")
    browser.find_element(By.NAME, "username").send_keys("operator")
    browser.find_element(By.NAME, "password").send_keys("s3cret-pw")
    browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    arrived(browser, target)
    # Then the page lists the row, with no server error and no wrong-scheduler banner
    assert "Server Error" not in browser.title
    assert "nightly-report" in browser.find_element(By.ID, "result_list").text
    assert "won't be dispatched" not in browser.find_element(By.ID, "content").text
