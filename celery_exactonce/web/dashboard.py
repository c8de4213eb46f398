"""What the dashboard's routes share: the Celery app, its store, the templates, the CSRF secret.

:class:`Dashboard` is kept on the Starlette app's state; a route gets it with
:func:`dashboard_of`. Its :meth:`~Dashboard.session` is the CLI's session on the
app's runtime in this process (:func:`celery_exactonce.runtime.runtime_for`),
opened at the first request without setting anything up: a store never set
up raises :class:`NotSetUp` (a 503 page that says to run ``migrate``). Every
error text it shows has the credentials of the store, broker and result
backend URLs blanked.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import jinja2
from starlette.requests import Request
from starlette.responses import Response
from starlette.templating import Jinja2Templates

from celery_exactonce import runtime
from celery_exactonce.cli import base
from celery_exactonce.stores import redact_secrets, redact_url, url_secrets
from celery_exactonce.web import security

#: The page every error page is.
ERROR_TEMPLATE = "error.html"


class NotSetUp(Exception):
    """The store was never set up: a 503 page that says to run ``migrate``."""


class Dashboard:
    """What the routes share: the Celery app, the options, the templates, the CSRF secret."""

    def __init__(
        self,
        celery_app: Any,
        *,
        actions: bool,
        auth: security.Auth,
        allowed_hosts: Sequence[str] | None,
    ) -> None:
        self.celery_app = celery_app
        self.actions = actions
        self.auth = auth
        self.allowed_hosts = None if allowed_hosts is None else frozenset(allowed_hosts)
        #: The per-process secret of the CSRF tokens (a restart voids the old ones).
        self.secret = secrets.token_bytes(32)
        self.templates = Jinja2Templates(env=_environment())
        self._set_up = False

    @contextmanager
    def session(self) -> Iterator[base.Session]:
        """The app's settings and store, as the CLI's commands get them (not closed:
        the store is the runtime's, kept for the next request)."""
        rt = runtime.runtime_for(self.celery_app, setup=False)
        if not self._set_up:
            if rt.store.schema_version() is None:
                raise NotSetUp(
                    f"the store {redact_url(rt.config.store_url)} was never set up: a worker "
                    "or beat sets it up at start, or run `celery -A APP exactonce migrate`"
                )
            self._set_up = True
        yield base.Session(self.celery_app, rt.config, rt.store)

    def credentials(self) -> list[str]:
        """Every credential of the store, broker and result backend URLs, to blank out."""
        found = []
        conf = self.celery_app.conf
        urls = ("exactonce_store_url", "broker_url", "result_backend")
        for url in (conf.get(name) for name in urls):
            for one in url if isinstance(url, list | tuple) else [url]:
                found += url_secrets(one) if isinstance(one, str) else []
        return found

    def shown(self, text: str) -> str:
        """``text`` with every credential this app knows of blanked out."""
        return redact_secrets(text, self.credentials())

    def render(
        self, request: Request, name: str, context: dict[str, Any], status: int = 200
    ) -> Response:
        """The template ``name`` with ``context``, the actions' flag and CSRF tokens."""
        context = {
            "page": "",
            "actions": self.actions,
            "csrf": lambda purpose: security.csrf_token(self.secret, purpose),
            **context,
        }
        return self.templates.TemplateResponse(request, name, context, status_code=status)

    def error(self, request: Request, status: int, title: str, message: str) -> Response:
        """An error page: ``status``, ``title``, and ``message`` with credentials blanked."""
        context = {"status": status, "title": title, "message": self.shown(message)}
        return self.render(request, ERROR_TEMPLATE, context, status)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("celery_exactonce.web", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["when"] = _when
    env.filters["ago"] = base.duration
    return env


def _when(value: str | datetime | None) -> str:
    """An instant to the second, UTC: ``2026-05-01 03:00:00Z`` (``-`` for none)."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return base.short_time(value)


def dashboard_of(request: Request) -> Dashboard:
    """The :class:`Dashboard` the request's app serves."""
    dash: Dashboard = request.app.state.dashboard
    return dash
