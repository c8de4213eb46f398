"""The read-only admin: the job list (with its filters) and every job's page render.

Jobs in every state are written by the django:// store, as the protocol
writes them; the pages are fetched with Django's test client as a superuser.
(The same pages in a real browser: tests/acceptance/test_django_admin.py.)
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from celery_exactonce.contrib.django.models import Job
from celery_exactonce.core.jobs import Job as Record
from celery_exactonce.core.skipped_slots import SkippedSlots
from celery_exactonce.core.states import State
from celery_exactonce.stores.base import StateStore
from tests.support import helpers
from tests.support.helpers import move, occurrence


def jobs_in_every_state(store: StateStore) -> dict[State, Record]:
    """A job of its own in each state, and a beat occurrence (``nightly``) ``DISPATCHED``."""
    made = helpers.jobs_in_every_state(store)
    fired = store.create(occurrence("nightly", datetime(2026, 5, 1, 3, tzinfo=timezone.utc))).job
    assert fired is not None
    move(store, fired, State.DISPATCHED)
    return made


@pytest.fixture
def client(alias: str) -> Iterator[object]:
    from django.contrib.auth.models import User
    from django.test import Client

    admin = User.objects.create_superuser("admin", "admin@example.com", "pw")
    client = Client()
    client.force_login(admin)
    yield client


def test_the_job_list_and_its_filters_render_every_state(client: object, store: StateStore) -> None:
    made = jobs_in_every_state(store)
    page = client.get("/admin/celery_exactonce/job/")  # type: ignore[attr-defined]
    assert page.status_code == 200
    text = page.content.decode()
    for job in made.values():
        assert job.ref.id in text
    for query, shown, hidden in [
        ("state=RUNNING", "job-running", "job-failed"),
        ("task=tasks.failed", "job-failed", "job-running"),
        ("age=hour", "job-running", None),
        ("age=older", None, "job-running"),
        (f"namespace={store.namespace}", "job-timeout", None),
        ("q=nightly", "nightly", "job-running"),
    ]:
        page = client.get(f"/admin/celery_exactonce/job/?{query}")  # type: ignore[attr-defined]
        assert page.status_code == 200, query
        text = page.content.decode()
        if shown:
            assert shown in text, query
        if hidden:
            assert hidden not in text, query


def test_every_jobs_page_shows_its_record(client: object, store: StateStore) -> None:
    from django.contrib.admin.utils import quote
    from django.urls import reverse

    made = jobs_in_every_state(store)
    for state, job in made.items():
        key = f"{store.namespace}:{job.ref.space.value}:{job.ref.id}"
        url = reverse("admin:celery_exactonce_job_change", args=[quote(key)])
        page = client.get(url)  # type: ignore[attr-defined]
        assert page.status_code == 200, (state, url)
        text = page.content.decode()
        model = Job.objects.get(key=key)
        assert model.idempotency_key() in text
        assert state.value in text
        assert "ü" in text  # the kwargs, from the payload
        assert "Save" not in text  # read-only: no form to submit


def test_the_admin_refuses_every_change(client: object, store: StateStore) -> None:
    jobs_in_every_state(store)
    assert client.get("/admin/celery_exactonce/job/add/").status_code == 403  # type: ignore[attr-defined]
    key = Job.objects.first().key
    from django.contrib.admin.utils import quote

    page = client.post(f"/admin/celery_exactonce/job/{quote(key)}/delete/")  # type: ignore[attr-defined]
    assert page.status_code == 403
    assert Job.objects.filter(key=key).exists()


def test_the_beat_entries_page_shows_each_watermark(client: object, store: StateStore) -> None:
    store.create(occurrence("nightly", datetime(2026, 5, 1, 3, tzinfo=timezone.utc)))
    page = client.get("/admin/celery_exactonce/watermark/")  # type: ignore[attr-defined]
    assert page.status_code == 200
    assert "nightly" in page.content.decode()


def test_the_skipped_slots_page_lists_each_record_and_filters_by_reason(
    client: object, store: StateStore
) -> None:
    first = datetime(2026, 5, 1, 3, tzinfo=timezone.utc)
    store.note_skipped(
        [
            SkippedSlots("nightly", "catchup", first, first + timedelta(days=2), 3, "beat-1"),
            SkippedSlots("hourly", "window", first, first + timedelta(hours=4), 5, "beat-2"),
        ]
    )
    page = client.get("/admin/celery_exactonce/skippedslots/")  # type: ignore[attr-defined]
    assert page.status_code == 200
    text = page.content.decode()
    assert "nightly" in text and "hourly" in text and "beat-2" in text
    page = client.get("/admin/celery_exactonce/skippedslots/?reason=window")  # type: ignore[attr-defined]
    listed = page.content.decode().split('id="result_list"', 1)[1].split("</table>", 1)[0]
    assert "hourly" in listed and "nightly" not in listed  # (the filters still name both)


def test_a_range_several_nodes_skipped_is_one_row_naming_each_node(
    client: object, store: StateStore
) -> None:
    """Every node plans every entry, so a range all skipped is noted once per node.

    Before, the page listed one row per node for the same range, so a loss
    that three beats met looked like three.
    """
    first = datetime(2026, 5, 1, 3, tzinfo=timezone.utc)
    last = first + timedelta(hours=2)
    store.note_skipped(
        [SkippedSlots("hourly", "store_loss", first, last, 3, node) for node in ("b-1", "b-2")]
        + [SkippedSlots("hourly", "window", first, last, 3, "b-1")]
    )
    page = client.get("/admin/celery_exactonce/skippedslots/")  # type: ignore[attr-defined]
    assert page.status_code == 200
    listed = page.content.decode().split('id="result_list"', 1)[1].split("</table>", 1)[0]
    assert listed.count("store_loss") == 1 and listed.count("window") == 1
    assert "b-2, b-1" in listed


@pytest.mark.parametrize(
    ("scheduler", "wrong"),
    [
        ("exactonce-django", False),  # the form the how-to and the migration guide write
        ("celery_exactonce.contrib.django_celery_beat:DatabaseScheduler", False),
        ("django_celery_beat.schedulers:DatabaseScheduler", False),
        ("exactonce", True),  # beat_schedule only: the rows would not run
        ("no-such-scheduler", True),
    ],
)
def test_scenario_79_the_periodic_tasks_page_knows_the_scheduler_alias(
    client: object, settings: Any, scheduler: str, wrong: bool
) -> None:
    """SCENARIOS 79: django-celery-beat's "Periodic tasks" page under each scheduler setting.

    Before the fix, ``CELERY_BEAT_SCHEDULER = "exactonce-django"`` made the page
    fail with HTTP 500 (django-celery-beat imported the alias as a module), and
    the scheduler's full path counted as a wrong scheduler (``wrong_scheduler``:
    the page's "won't be dispatched" banner, where its template shows it).
    """
    settings.CELERY_BEAT_SCHEDULER = scheduler
    page = client.get("/admin/django_celery_beat/periodictask/")  # type: ignore[attr-defined]
    assert page.status_code == 200
    assert "Select periodic task to change" in page.content.decode()
    assert page.context_data["wrong_scheduler"] is wrong
