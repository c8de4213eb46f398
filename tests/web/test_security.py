"""Who may see the dashboard and act through it: auth, actions, CSRF, origin, hosts, input.

On the memory store (:class:`tests.web.conftest.Site`); the same guard serves
every store. Each refusal is a page of its own with its status, never a
traceback.
"""

from __future__ import annotations

import base64
import sys
from typing import Any

import pytest

from celery_exactonce.core import exceptions
from celery_exactonce.core.states import State
from celery_exactonce.observe import metrics
from celery_exactonce.web import Auth, create_app, security
from tests.web.conftest import Site, form_of

pytestmark = pytest.mark.timeout(60)

ORIGIN = {"Origin": "http://testserver"}


def basic(user: str, password: str) -> dict[str, str]:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


# -- auth -----------------------------------------------------------------------------------


def test_with_a_token_every_request_without_it_gets_401(memory_site: Site) -> None:
    client = memory_site.client(auth=Auth(token="t0ken-value"))
    for path in ("/", "/jobs", "/job?id=job-running", "/entries", "/health", "/nope"):
        page = client.get(path)
        assert page.status_code == 401, path
        assert page.headers["WWW-Authenticate"].startswith("Basic")
        assert "job-running" not in page.text
    assert client.post("/actions/cancel", data={"task_id": "job-pending"}).status_code == 401
    # A wrong token, or another scheme, is refused too
    assert client.get("/jobs", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/jobs", headers={"Authorization": "t0ken-value"}).status_code == 401
    # The token admits: as a bearer token, or as basic auth's password (a browser)
    assert client.get("/jobs", headers={"Authorization": "Bearer t0ken-value"}).status_code == 200
    assert client.get("/jobs", headers=basic("anyone", "t0ken-value")).status_code == 200


def test_with_basic_auth_only_the_user_and_password_admit(memory_site: Site) -> None:
    client = memory_site.client(auth=Auth(user="op", password="pw-0f-op"))
    assert client.get("/jobs").status_code == 401
    assert client.get("/jobs", headers=basic("op", "wrong")).status_code == 401
    assert client.get("/jobs", headers=basic("other", "pw-0f-op")).status_code == 401
    assert client.get("/jobs", headers={"Authorization": "Basic !!!"}).status_code == 401
    assert client.get("/jobs", headers=basic("op", "pw-0f-op")).status_code == 200


def test_auth_settings_that_cannot_work_are_refused_and_never_shown() -> None:
    with pytest.raises(ValueError, match="both a user and a password"):
        Auth(user="op")
    with pytest.raises(ValueError, match="empty"):
        Auth(token=" ")
    assert "s3cret" not in repr(Auth(token="s3cret", user="u", password="s3cret"))


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),  # noqa: S104 (the address under test)
        ("::", False),
        ("192.168.1.10", False),
        ("example.com", False),
    ],
)
def test_only_loopback_addresses_count_as_this_machine_alone(address: str, loopback: bool) -> None:
    assert security.is_loopback(address) is loopback


def test_a_host_name_not_the_dashboards_is_refused(memory_site: Site) -> None:
    client = memory_site.client(allowed_hosts=security.loopback_hosts("127.0.0.1"))
    assert client.get("/jobs", headers={"Host": "127.0.0.1:8000"}).status_code == 200
    assert client.get("/jobs", headers={"Host": "localhost:8000"}).status_code == 200
    assert client.get("/jobs", headers={"Host": "[::1]:8000"}).status_code == 200
    page = client.get("/jobs", headers={"Host": "rebound.example:8000"})
    assert page.status_code == 400
    assert "job-running" not in page.text


# -- actions --------------------------------------------------------------------------------


def test_without_actions_there_is_no_button_and_every_action_gets_403(memory_site: Site) -> None:
    client = memory_site.client()
    page = client.get("/job?id=job-pending")
    assert page.status_code == 200 and 'id="cancel"' not in page.text
    assert 'id="reconcile"' not in client.get("/health").text
    for path, data in (("/actions/cancel", {"task_id": "job-pending"}), ("/actions/reconcile", {})):
        refused = client.post(path, data=data, headers=ORIGIN)
        assert refused.status_code == 403, path
        assert "actions are off" in refused.text
    assert memory_site.store.get(memory_site.jobs[State.PENDING].ref).state is State.PENDING


def test_with_actions_a_pending_job_is_cancelled_through_its_page(memory_site: Site) -> None:
    metrics.COUNTERS.reset()
    client = memory_site.client(actions=True)
    # Given the page of a delayed job not dispatched yet, with its cancel button
    page = client.get("/job?id=job-pending")
    assert 'id="cancel"' in page.text
    form = form_of(page.text, "/actions/cancel")
    # When the form is posted from the dashboard's page
    done = client.post("/actions/cancel", data=form, headers=ORIGIN)
    # Then the job is CANCELLED, and the page says so
    assert done.status_code == 200
    assert "cancelled job-pending: it will not run" in done.text
    job = memory_site.store.get(memory_site.jobs[State.PENDING].ref)
    assert job is not None and job.state is State.CANCELLED
    assert metrics.COUNTERS.get("dashboard_action") == 1
    # And a dispatched job has no button, and a forged post of one cancels nothing
    page = client.get("/job?id=job-running")
    assert 'id="cancel"' not in page.text
    form = {**form, "task_id": "job-running"}
    done = client.post("/actions/cancel", data=form, headers=ORIGIN)
    assert done.status_code == 200 and "not cancelled" in done.text and "RUNNING" in done.text
    assert memory_site.store.get(memory_site.jobs[State.RUNNING].ref).state is State.RUNNING


def _cancel_form(client: Any) -> dict[str, str]:
    return form_of(client.get("/job?id=job-pending").text, "/actions/cancel")


@pytest.mark.parametrize(
    ("change", "headers", "why"),
    [
        ({"csrf": None}, ORIGIN, "CSRF token"),
        ({"csrf": "1700000000.abcdef"}, ORIGIN, "CSRF token"),
        ({"csrf": "reconcile"}, ORIGIN, "CSRF token"),  # a token of another action
        ({}, {"Origin": "http://evil.example"}, "does not come from"),
        ({}, {"Referer": "http://evil.example/jobs"}, "does not come from"),
        ({}, {}, "does not come from"),  # neither Origin nor Referer
        ({}, {"Origin": "null"}, "does not come from"),
    ],
)
def test_an_action_without_a_good_csrf_token_or_from_elsewhere_gets_403(
    memory_site: Site, change: dict[str, str | None], headers: dict[str, str], why: str
) -> None:
    dash = memory_site.client(actions=True)
    form = _cancel_form(dash)
    for name, value in change.items():
        if value is None:
            form.pop(name)
        elif value == "reconcile":
            form[name] = form_of(dash.get("/health").text, "/actions/reconcile")["csrf"]
        else:
            form[name] = value
    refused = dash.post("/actions/cancel", data=form, headers=headers)
    assert refused.status_code == 403
    assert why in refused.text
    assert memory_site.store.get(memory_site.jobs[State.PENDING].ref).state is State.PENDING


def test_a_referer_of_the_dashboard_will_do_without_an_origin(memory_site: Site) -> None:
    dash = memory_site.client(actions=True)
    done = dash.post(
        "/actions/cancel",
        data=_cancel_form(dash),
        headers={"Referer": "http://testserver/job?id=job-pending"},
    )
    assert done.status_code == 200 and "cancelled job-pending" in done.text


def test_actions_are_post_only(memory_site: Site) -> None:
    dash = memory_site.client(actions=True)
    assert dash.get("/actions/cancel?task_id=job-pending").status_code == 405
    assert dash.get("/actions/reconcile").status_code == 405
    assert memory_site.store.get(memory_site.jobs[State.PENDING].ref).state is State.PENDING


def test_a_reconcile_pass_runs_from_the_health_page(memory_site: Site) -> None:
    dash = memory_site.client(actions=True)
    form = form_of(dash.get("/health").text, "/actions/reconcile")
    done = dash.post("/actions/reconcile", data=form, headers=ORIGIN)
    assert done.status_code == 200
    assert 'id="outcome" class="ok">pass:' in done.text
    assert "<th>ran</th><td>True</td>" in done.text


def test_the_csrf_token_expires_and_is_bound_to_its_secret_and_action() -> None:
    token = security.csrf_token(b"k" * 32, "cancel", now=1_000_000)
    assert security.csrf_valid(b"k" * 32, "cancel", token, now=1_000_100)
    assert not security.csrf_valid(b"k" * 32, "cancel", token, now=1_000_000 + 13 * 3600)
    assert not security.csrf_valid(b"o" * 32, "cancel", token, now=1_000_100)
    assert not security.csrf_valid(b"k" * 32, "reconcile", token, now=1_000_100)
    assert not security.csrf_valid(b"k" * 32, "cancel", None)


# -- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "culprit"),
    [
        ("/jobs?state=NOPE", "state: 'NOPE' is not a state"),
        ("/jobs?older_than=soon", "older_than: 'soon' is not an age"),
        ("/jobs?limit=0", "limit: '0' is not a number of jobs"),
        ("/jobs?limit=many", "limit: 'many' is not a number"),
        ("/jobs?cursor=garbage", "cursor: 'garbage' is not a cursor this page printed"),
        ("/jobs?state=PENDING&cursor=RUNNING:1:t:x", "cursor: the cursor is of a state not asked"),
        ("/jobs?task=%01bad", "task: task '\\x01bad' contains control characters"),
        ("/jobs?entry=" + "e" * 300, "entry: entry 'eeee"),
        ("/jobs?id=%07", "id: task id '\\x07' contains control characters"),
        ("/job?id=" + "x" * 201, "task id: task id 'xxxx"),
        ("/job", "id: no job id given"),
    ],
)
def test_bad_input_gets_a_400_page_naming_the_culprit(
    memory_site: Site, path: str, culprit: str
) -> None:
    page = memory_site.client().get(path)
    assert page.status_code == 400
    assert "<h1>400 Bad" in page.text
    assert culprit in page.text.replace("&#39;", "'").replace("&#x27;", "'")
    assert "Traceback" not in page.text


def test_a_malformed_cancel_form_gets_a_400_page(memory_site: Site) -> None:
    dash = memory_site.client(actions=True)
    form = {**_cancel_form(dash), "task_id": ""}
    page = dash.post("/actions/cancel", data=form, headers=ORIGIN)
    assert page.status_code == 400 and "task_id: task id must not be empty" in page.text


# -- the extra ------------------------------------------------------------------------------


def test_without_the_web_extra_the_error_says_what_to_install(
    memory_site: Site, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "starlette", None)
    with pytest.raises(exceptions.ConfigurationError) as caught:
        create_app(memory_site.app)
    assert str(caught.value) == (
        "the dashboard needs an optional dependency (starlette): "
        "pip install 'celery-exactonce[web]'"
    )


# -- mounted in a site ----------------------------------------------------------------------


def test_mounted_in_a_site_its_links_and_forms_stay_under_the_mount(memory_site: Site) -> None:
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Mount, Route
    from starlette.testclient import TestClient

    # Given a site that mounts the dashboard under /ops/exactonce, behind its own auth
    dashboard = create_app(memory_site.app, actions=True, auth=Auth(token="t0k"))
    site = Starlette(
        routes=[
            Mount("/ops/exactonce", app=dashboard),
            Route("/", lambda request: PlainTextResponse("the site")),
        ]
    )
    client = TestClient(site, follow_redirects=True, headers={"Authorization": "Bearer t0k"})
    # Then its front page, links and forms are under the mount
    page = client.get("/ops/exactonce/")
    assert page.status_code == 200 and str(page.url).endswith("/ops/exactonce/jobs")
    assert 'href="http://testserver/ops/exactonce/job?id=job-pending"' in page.text
    job = client.get("/ops/exactonce/job?id=job-pending")
    form = form_of(job.text, "/ops/exactonce/actions/cancel")
    done = client.post("/ops/exactonce/actions/cancel", data=form, headers=ORIGIN)
    assert done.status_code == 200 and "cancelled job-pending" in done.text
    # ... and the site's own pages are the site's
    assert client.get("/").text == "the site"


def test_no_page_can_be_framed_by_another_site_or_run_a_script(memory_site: Site) -> None:
    client = memory_site.client(actions=True, auth=Auth(token="t0k"))
    shown = client.get("/job?id=job-pending", headers={"Authorization": "Bearer t0k"})
    for page in (shown, client.get("/jobs")):  # a page, and a 401
        assert page.headers["X-Frame-Options"] == "DENY"
        assert "frame-ancestors 'none'" in page.headers["Content-Security-Policy"]
        assert "default-src 'none'" in page.headers["Content-Security-Policy"]
        assert page.headers["Cache-Control"] == "no-store"
        assert "<script" not in page.text


@pytest.mark.parametrize(
    ("origin", "referer", "host", "same"),
    [
        ("http://127.0.0.1:8000", None, "127.0.0.1:8000", True),
        ("https://ops.example", None, "ops.example", True),  # the scheme's port
        ("https://ops.example:443", None, "OPS.example", True),
        (None, "http://ops.example/job?id=x", "ops.example:80", True),
        ("http://ops.example:8001", None, "ops.example:8000", False),
        ("http://ops.example.evil", None, "ops.example", False),
        ("null", "http://ops.example/", "ops.example", True),  # a Referer stands in
        ("javascript:x", None, "ops.example", False),
        (None, None, "ops.example", False),
    ],
)
def test_the_same_origin_check(
    origin: str | None, referer: str | None, host: str, same: bool
) -> None:
    assert security.same_origin(origin, referer, host) is same
