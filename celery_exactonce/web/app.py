"""The dashboard as a Starlette app: its routes, its guard, its error pages.

:func:`build` is what :func:`celery_exactonce.web.create_app` returns. Each
page's data comes from :mod:`celery_exactonce.web.pages`; the actions are
:mod:`celery_exactonce.web.actions`'; who may ask is
:mod:`celery_exactonce.web.security`'s; what the routes share (the store, the
templates) :mod:`celery_exactonce.web.dashboard`'s.

Every error is a page of its own, never a traceback: bad input 400 (naming
the culprit), no auth 401, an action refused 403, nothing there 404, a store
that cannot be read 503, anything else 500 ("see the log"). No page shows a
credential: the store's URL is shown redacted, and an error's text has every
credential of the store and broker URLs blanked before it is shown.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any
from urllib.parse import urlencode, urlsplit

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from celery_exactonce.cli import base
from celery_exactonce.core import exceptions
from celery_exactonce.observe import metrics
from celery_exactonce.web import pages, security
from celery_exactonce.web.dashboard import Dashboard, NotSetUp, dashboard_of

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: What a 401 page says (no template: it is answered before any route).
UNAUTHORIZED = (
    "<!doctype html><title>401 Unauthorized</title>"
    "<h1>401 Unauthorized</h1><p>This dashboard asks for credentials.</p>"
)
#: What a page with a host name the dashboard does not answer to gets.
UNKNOWN_HOST = (
    "<!doctype html><title>400 Bad Request</title>"
    "<h1>400 Bad Request</h1><p>The host name of this request is not the dashboard's.</p>"
)
#: On every answer: no page in a frame of another site (its buttons under a decoy), no
#: script, forms posted only here, no caching of pages of jobs.
GUARD_HEADERS = [
    (b"x-frame-options", b"DENY"),
    (
        b"content-security-policy",
        b"default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; "
        b"frame-ancestors 'none'; base-uri 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
]


# -- the guard: host names and credentials, before any route ------------------------------


class Guard:
    """Answers 400 to a host name the dashboard does not answer to, and 401 to a request
    without the credentials of :class:`~celery_exactonce.web.security.Auth`; puts
    :data:`GUARD_HEADERS` on every answer."""

    def __init__(self, app: ASGIApp, dashboard: Dashboard) -> None:
        self.app = app
        self.dashboard = dashboard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def guarded(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *GUARD_HEADERS]
            await send(message)

        await self.guard(scope, receive, guarded)

    async def guard(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        allowed = self.dashboard.allowed_hosts
        if allowed is not None and _hostname(headers.get("host", "")) not in allowed:
            _refused("host", scope)
            await HTMLResponse(UNKNOWN_HOST, status_code=400)(scope, receive, send)
            return
        auth = self.dashboard.auth
        if not auth.admits(headers.get("authorization")):
            _refused("auth", scope, level=logging.DEBUG)  # a browser's first request asks so
            response = HTMLResponse(
                UNAUTHORIZED, status_code=401, headers={"WWW-Authenticate": auth.challenge()}
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _hostname(host: str) -> str:
    try:
        return (urlsplit(f"//{host}").hostname or "").lower()
    except ValueError:
        return ""


def _refused(where: str, scope: Scope, *, level: int = logging.WARNING) -> None:
    client = scope.get("client") or ("?", 0)
    metrics.event(
        "dashboard_refused",
        "dashboard: refused %s %s from %s (%s)",
        scope.get("method"),
        scope.get("path"),
        client[0],
        where,
        level=level,
        labels={"where": where},
        client=client[0],
    )


# -- the pages ----------------------------------------------------------------------------


def _query(request: Request) -> dict[str, list[str]]:
    query: dict[str, list[str]] = {}
    for key, value in request.query_params.multi_items():
        query.setdefault(key, []).append(value)
    return query


async def jobs(request: Request) -> Response:
    """The jobs page (:func:`~celery_exactonce.web.pages.jobs_page`), or the job found."""
    dash = dashboard_of(request)

    def read() -> dict[str, Any] | pages.Found:
        with dash.session() as s:
            return pages.jobs_page(s, _query(request))

    data = await run_in_threadpool(read)
    if isinstance(data, pages.Found):
        target = request.url_for("job").include_query_params(id=data.task_id)
        return RedirectResponse(str(target), status_code=303)
    if "matches" in data:
        return dash.render(request, "matches.html", {"page": "jobs", **data})
    if data["next_cursor"]:
        query = {**{k: v for k, v in data["filters"].items() if v}, "cursor": data["next_cursor"]}
        data["next_url"] = f"{request.url_for('jobs')}?{urlencode(query, doseq=True)}"
    return dash.render(request, "jobs.html", {"page": "jobs", **data})


async def job(request: Request) -> Response:
    """One job's page (``/job?id=…``), or the ids its start is the start of."""
    dash = dashboard_of(request)
    task_id = pages.one(_query(request), "id")
    if task_id is None:
        raise pages.BadInput("id", "no job id given (/job?id=TASK_ID)")

    def read() -> dict[str, Any]:
        with dash.session() as s:
            return pages.job_page(s, task_id)

    data = await run_in_threadpool(read)
    name = "matches.html" if "matches" in data else "job.html"
    return dash.render(request, name, {"page": "jobs", **data})


async def entries(request: Request) -> Response:
    """The beat entries' page."""
    dash = dashboard_of(request)

    def read() -> dict[str, Any]:
        with dash.session() as s:
            return pages.entries_page(s)

    data = await run_in_threadpool(read)
    return dash.render(request, "entries.html", {"page": "entries", **data})


async def health(request: Request) -> Response:
    """The store's health page."""
    dash = dashboard_of(request)

    def read() -> dict[str, Any]:
        with dash.session() as s:
            return pages.health_page(s)

    data = await run_in_threadpool(read)
    return dash.render(request, "health.html", {"page": "health", **data})


async def home(request: Request) -> Response:
    """The front page: the jobs."""
    return RedirectResponse(str(request.url_for("jobs")), status_code=303)


# -- the error pages ----------------------------------------------------------------------


async def _bad_input(request: Request, exc: Exception) -> Response:
    field = getattr(exc, "field", "input")
    return dashboard_of(request).error(request, 400, f"Bad {field}", f"{field}: {exc}")


async def _not_found(request: Request, exc: Exception) -> Response:
    return dashboard_of(request).error(request, 404, "Not found", str(exc))


async def _not_set_up(request: Request, exc: Exception) -> Response:
    return dashboard_of(request).error(request, 503, "Store not set up", str(exc))


async def _http(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 500)
    detail = str(getattr(exc, "detail", "") or "")
    titles = {404: "Not found", 405: "Method not allowed"}
    text = "no page here" if status == 404 else detail
    return dashboard_of(request).error(request, status, titles.get(status, detail), text)


async def _failed(request: Request, exc: Exception) -> Response:
    dash = dashboard_of(request)
    if isinstance(exc, exceptions.StoreError):
        text = f"the store of exactonce_store_url cannot be read or written: {base.one_line(exc)}"
        status, title = 503, "Store unavailable"
    elif isinstance(exc, exceptions.ConfigurationError):
        status, title, text = 500, "Configuration refused", base.setting_message(exc)
    else:
        status, title, text = 500, "Internal error", "the dashboard failed: see its log"
    metrics.event(
        "dashboard_error",
        "dashboard: %s %s failed: %s",
        request.method,
        request.url.path,
        dash.shown(f"{type(exc).__name__}: {base.one_line(exc)}"),
        level=logging.WARNING if status == 503 else logging.ERROR,
    )
    return dash.error(request, status, title, text)


# -- the app ------------------------------------------------------------------------------


def build(
    celery_app: Any,
    *,
    actions: bool = False,
    auth: security.Auth | None = None,
    allowed_hosts: Sequence[str] | None = None,
) -> Starlette:
    """The dashboard of ``celery_app`` (see :func:`celery_exactonce.web.create_app`)."""
    from celery_exactonce.web import actions as acting

    dashboard = Dashboard(
        celery_app, actions=actions, auth=auth or security.Auth(), allowed_hosts=allowed_hosts
    )
    routes = [
        Route("/", home, name="home"),
        Route("/jobs", jobs, name="jobs"),
        Route("/job", job, name="job"),
        Route("/entries", entries, name="entries"),
        Route("/health", health, name="health"),
        *acting.routes(),
    ]
    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        pages.BadInput: _bad_input,
        pages.NotFound: _not_found,
        NotSetUp: _not_set_up,
        HTTPException: _http,
        exceptions.ExactOnceError: _failed,  # a page of its own, not a server error
        Exception: _failed,  # the same page; the server logs the traceback
        **acting.handlers(),
    }
    app = Starlette(routes=routes, exception_handlers=handlers)
    app.state.dashboard = dashboard
    app.add_middleware(Guard, dashboard=dashboard)
    return app
