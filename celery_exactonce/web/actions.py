"""The dashboard's actions: cancel a job not dispatched yet, run one reconcile pass,
pause and resume a stored entry.

Only with ``actions=True`` (``exactonce web --actions``); otherwise the pages
show no button and each endpoint answers 403. Each is a POST of a form, and
is refused (403) unless the form carries a CSRF token this process issued for
that action (:func:`~celery_exactonce.web.security.csrf_token`) and the
request's ``Origin`` (or ``Referer``) is the dashboard's own host. What each
does is the CLI's: ``cancel`` (:func:`celery_exactonce.cli.act.cancel_job`),
``reconcile`` (one :class:`~celery_exactonce.reconcile.reconciler.Reconciler`
pass under its lease), and ``schedule pause|resume``
(:func:`celery_exactonce.entries.pause` and :func:`~celery_exactonce.entries.resume`,
for the entries stored at run time). Each action taken is the ``dashboard_action``
event; each refused, ``dashboard_refused``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

import click
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from celery_exactonce import entries, runtime
from celery_exactonce.cli import act, base
from celery_exactonce.core import exceptions
from celery_exactonce.observe import metrics
from celery_exactonce.reconcile.reconciler import Reconciler
from celery_exactonce.web import pages, security
from celery_exactonce.web.dashboard import dashboard_of

#: The largest form an action takes (a task id and a token are far less).
MAX_FORM = 16 * 1024


class Refused(Exception):
    """An action refused before it ran: a 403 page saying why (``where``: the check)."""

    def __init__(self, where: str, message: str) -> None:
        self.where = where
        super().__init__(message)


async def _form(request: Request) -> dict[str, str]:
    """The POSTed form's fields (the last value of each); bad input past :data:`MAX_FORM`."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM:
            raise pages.BadInput("form", f"the form is over {MAX_FORM} bytes")
    try:
        fields = parse_qs(body.decode("utf-8"), keep_blank_values=True, strict_parsing=False)
    except UnicodeDecodeError:
        raise pages.BadInput("form", "the form is not UTF-8") from None
    return {name: values[-1] for name, values in fields.items()}


async def _checked(request: Request, purpose: str) -> dict[str, str]:
    """The form of an allowed, same-origin action carrying a good CSRF token; else Refused."""
    dash = dashboard_of(request)
    if not dash.actions:
        raise Refused("actions", "actions are off: start the dashboard with --actions")
    headers = request.headers
    if not security.same_origin(headers.get("origin"), headers.get("referer"), headers.get("host")):
        raise Refused("origin", "the request does not come from a page of this dashboard")
    form = await _form(request)
    if not security.csrf_valid(dash.secret, purpose, form.get("csrf")):
        raise Refused("csrf", "the form's CSRF token is missing, wrong or expired: reload the page")
    return form


def _taken(request: Request, what: str, target: str, outcome: str) -> None:
    metrics.event(
        "dashboard_action",
        "dashboard: %s %s: %s",
        what,
        target,
        outcome,
        what=what,
        target=target,
        outcome=outcome,
        client=request.client.host if request.client else None,
    )


async def cancel(request: Request) -> Response:
    """Cancel the job the form's ``task_id`` names (or starts), as ``exactonce cancel``."""
    form = await _checked(request, "cancel")
    dash = dashboard_of(request)
    task_id = pages.task_id_of(form.get("task_id", ""), "task_id")

    def run() -> act.Cancelled:
        with dash.session() as s:
            try:
                return act.cancel_job(s, task_id)
            except click.BadParameter as exc:
                raise pages.BadInput("task_id", exc.message) from None

    done = await run_in_threadpool(run)
    if done.cancelled:
        message = f"cancelled {done.task_id}: it will not run"
    elif done.already:
        message = f"{done.task_id} was cancelled already (CANCELLED): it will not run"
    else:
        message = f"not cancelled: {done.refusal}"
    _taken(request, "cancel", done.task_id, message)
    context = {"title": "Cancel", "ok": done.refusal is None, "message": message}
    return dash.render(request, "action.html", {**context, "task_id": done.task_id, "report": None})


async def reconcile(request: Request) -> Response:
    """One reconciler pass now, as ``exactonce reconcile``: its report."""
    await _checked(request, "reconcile")
    dash = dashboard_of(request)

    def run() -> tuple[dict[str, Any], str, bool, int]:
        with dash.session() as s:
            report = Reconciler(runtime.runtime_for(s.app, setup=False)).run_pass()
        return report.as_dict(), report.summary(), report.ran, report.errors

    data, summary, ran, errors = await run_in_threadpool(run)
    if not ran:
        message = "the pass did not run: another node holds the reconciler's lease"
    elif errors:
        message = f"the pass met {errors} store error(s): see the log ({summary})"
    else:
        message = f"pass: {summary}"
    _taken(request, "reconcile", "-", message)
    report = [(k, base.plain(v)) for k, v in data.items()]
    context = {"title": "Reconcile", "ok": ran and not errors, "message": message}
    return dash.render(request, "action.html", {**context, "task_id": None, "report": report})


async def pause(request: Request) -> Response:
    """Pause the stored entry the form's ``entry`` names, as ``exactonce schedule pause``."""
    return await _pausing(request, paused=True)


async def resume(request: Request) -> Response:
    """Resume the stored entry the form's ``entry`` names, as ``exactonce schedule resume``."""
    return await _pausing(request, paused=False)


async def _pausing(request: Request, *, paused: bool) -> Response:
    what = "pause" if paused else "resume"
    form = await _checked(request, what)
    dash = dashboard_of(request)
    name = form.get("entry", "")

    def run() -> entries.StoredEntry:
        with dash.session() as s:
            try:
                return (entries.pause if paused else entries.resume)(s.app, name)
            except KeyError:
                raise pages.NotFound(f"no stored entry {name!r}") from None
            except exceptions.InvalidPayload as exc:
                raise pages.BadInput("entry", str(exc)) from None

    entry = await run_in_threadpool(run)
    if paused:
        message = f"paused {entry.name}: no beat node fires it until it is resumed"
    else:
        since = base.short_time(entry.since)
        message = f"resumed {entry.name}: its slots from {since} on fire (none from before)"
    _taken(request, what, entry.name, message)
    context = {"title": what.capitalize(), "ok": True, "message": message}
    return dash.render(request, "action.html", {**context, "task_id": None, "report": None})


async def _refused(request: Request, exc: Exception) -> Response:
    where = getattr(exc, "where", "action")
    metrics.event(
        "dashboard_refused",
        "dashboard: refused %s %s (%s): %s",
        request.method,
        request.url.path,
        where,
        exc,
        level=logging.WARNING,
        labels={"where": where},
        client=request.client.host if request.client else None,
    )
    return dashboard_of(request).error(request, 403, "Forbidden", str(exc))


def routes() -> list[Route]:
    """The actions' endpoints (POST only)."""
    return [
        Route("/actions/cancel", cancel, methods=["POST"], name="cancel"),
        Route("/actions/reconcile", reconcile, methods=["POST"], name="reconcile"),
        Route("/actions/pause", pause, methods=["POST"], name="pause"),
        Route("/actions/resume", resume, methods=["POST"], name="resume"),
    ]


def handlers() -> dict[Any, Callable[[Request, Exception], Awaitable[Response]]]:
    """The error pages of the actions: a refusal is a 403 page."""
    return {Refused: _refused}
