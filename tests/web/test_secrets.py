"""No page of the dashboard shows a credential of the store or broker URL: every route.

The PostgreSQL store's URL carries :data:`~tests.web.conftest.SECRET` (trust
authentication ignores it), the broker URL of every app
:data:`~tests.web.conftest.BROKER_SECRET`, and the bearer token is one more
secret. Every page a person can reach is fetched (each page, each error page:
400, 401, 403, 404, 405, an action's answer, a store that cannot be reached
and one never set up) and searched for them, headers included.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_exactonce import entries, runtime
from celery_exactonce.web import Auth
from tests.web.conftest import BROKER_SECRET, NIGHTLY, SECRET, Site, form_of, make_app

pytestmark = pytest.mark.timeout(90)

TOKEN = "t0ken-0f-the-dashboard"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ORIGIN = {"Origin": "http://testserver", **AUTH}


def exposed(response: Any) -> list[str]:
    """The secrets the response shows, in its body or its headers."""
    text = response.text + "\n".join(f"{k}: {v}" for k, v in response.headers.items())
    return [s for s in (SECRET, BROKER_SECRET, TOKEN) if s in text]


def every_page(site: Site) -> Iterator[tuple[str, Any]]:
    """Each page of the dashboard, as ``(what, response)``."""
    options = {"exactonce": {"gated": False}}
    entries.save(site.app, "stored-report", "web.report", 300, options=options)
    read_only = site.client(auth=Auth(token=TOKEN))
    acting = site.client(auth=Auth(token=TOKEN), actions=True)
    for client in (read_only, acting):
        for path in (
            "/",
            "/jobs",
            "/jobs?state=PENDING&limit=1",
            "/jobs?id=job-",
            "/jobs?id=job-running",
            f"/jobs?entry={NIGHTLY}",
            f"/job?id={site.occurrence.id}",
            "/job?id=job-pending",
            "/job?id=job-",
            "/entries",
            "/health",
            "/jobs?state=NOPE",  # 400
            "/jobs?older_than=x",
            "/job?id=nobody",  # 404
            "/nowhere",
            "/actions/cancel",  # 405
        ):
            yield path, client.get(path, headers=AUTH)
        yield "401", client.get("/jobs")
        yield "401 wrong", client.get("/jobs", headers={"Authorization": "Bearer nope"})
    yield "403 actions off", read_only.post("/actions/reconcile", headers=ORIGIN)
    health = acting.get("/health", headers=AUTH).text
    yield "403 csrf", acting.post("/actions/cancel", data={"task_id": "x"}, headers=ORIGIN)
    job = acting.get("/job?id=job-pending", headers=AUTH).text
    cancel = form_of(job, "/actions/cancel")
    yield (
        "cancel refused",
        acting.post("/actions/cancel", data={**cancel, "task_id": "job-running"}, headers=ORIGIN),
    )
    yield "cancel", acting.post("/actions/cancel", data=cancel, headers=ORIGIN)
    yield (
        "cancel 400",
        acting.post("/actions/cancel", data={**cancel, "task_id": "\x01"}, headers=ORIGIN),
    )
    reconcile = form_of(health, "/actions/reconcile")
    yield "reconcile", acting.post("/actions/reconcile", data=reconcile, headers=ORIGIN)
    pause = form_of(acting.get("/entries", headers=AUTH).text, "/actions/pause")
    yield "pause", acting.post("/actions/pause", data=pause, headers=ORIGIN)
    yield "pause 404", acting.post("/actions/pause", data={**pause, "entry": "x"}, headers=ORIGIN)


def test_no_page_shows_a_credential(site: Site) -> None:
    seen = {}
    for what, response in every_page(site):
        seen[what] = response.status_code
        assert exposed(response) == [], (what, response.status_code)
    assert {200, 400, 401, 403, 404, 405} <= set(seen.values()), seen
    assert seen["cancel"] == seen["reconcile"] == seen["pause"] == 200, seen


def test_a_store_that_cannot_be_reached_is_a_503_page_without_its_password() -> None:
    # Given an app whose PostgreSQL store URL (with a password) points at a closed port
    app = make_app(f"postgresql://postgres:{SECRET}@127.0.0.1:1/test", f"w{uuid.uuid4().hex[:8]}")
    app.conf.exactonce_store_timeout = 2.0
    from starlette.testclient import TestClient

    from celery_exactonce.web import create_app

    client = TestClient(create_app(app), raise_server_exceptions=False)
    try:
        for path in ("/jobs", "/health", "/entries", "/job?id=x"):
            page = client.get(path)
            # Then each page is a 503 saying the store cannot be read, and never the password
            assert page.status_code == 503, (path, page.text[-400:])
            assert "cannot be read or written" in page.text
            assert exposed(page) == []
    finally:
        runtime.reset(app)


def test_a_store_never_set_up_is_a_503_page_that_says_to_run_migrate(tmp_path: Path) -> None:
    # Given an app on a SQLite store no node ever set up
    app = make_app(f"sqlite:///{tmp_path / 'never.db'}", f"w{uuid.uuid4().hex[:8]}")
    from starlette.testclient import TestClient

    from celery_exactonce.web import create_app

    client = TestClient(create_app(app), raise_server_exceptions=False)
    try:
        page = client.get("/jobs")
    finally:
        runtime.reset(app)
    # Then its pages say to set it up, and show no credential
    assert page.status_code == 503
    assert "was never set up" in page.text and "exactonce migrate" in page.text
    assert exposed(page) == []
