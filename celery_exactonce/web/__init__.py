"""The jobs dashboard: ``celery -A APP exactonce web``, or an ASGI app to mount in a site.

Server-rendered pages of what the store holds, on every store, read through
the CLI's data functions: the jobs (filtered, paged, found by the start of
their id), one job and its history, the beat entries (next slots, last
occurrence, skipped slots) and the store's health; with ``actions=True``,
cancelling a job not dispatched yet, running one reconcile pass, and pausing
or resuming a stored entry.
docs/howto/dashboard.md shows it.

It needs the ``web`` extra (Starlette, Jinja2, uvicorn):
``pip install 'celery-exactonce[web]'``. Its modules:

* :mod:`~celery_exactonce.web.app`: the Starlette app, its guard and error pages;
* :mod:`~celery_exactonce.web.pages`: what each page shows;
* :mod:`~celery_exactonce.web.actions`: the POST actions;
* :mod:`~celery_exactonce.web.security`: auth, CSRF tokens, hosts;
* :mod:`~celery_exactonce.web.server`: serving it with uvicorn (the command).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from celery_exactonce.core import exceptions
from celery_exactonce.web.security import Auth

__all__ = ["Auth", "create_app", "require"]

#: The packages the dashboard imports, each with the extra that brings it.
NEEDED = ("starlette", "jinja2")


def require(*modules: str) -> None:
    """Raise ``ConfigurationError`` with the ``pip install`` line unless ``modules``
    (default: :data:`NEEDED`) can be imported."""
    for module in modules or NEEDED:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise exceptions.ConfigurationError(
                f"the dashboard needs an optional dependency ({exc.name or module}): "
                "pip install 'celery-exactonce[web]'"
            ) from exc


def create_app(
    celery_app: Any,
    *,
    actions: bool = False,
    auth: Auth | None = None,
    allowed_hosts: Sequence[str] | None = None,
) -> Any:
    """The dashboard of ``celery_app`` as an ASGI app (a Starlette application).

    Mount it in a site (``Mount("/exactonce", app=create_app(app, auth=...))``),
    or serve it with any ASGI server. It reads the app's store through the
    app's runtime in this process.

    Parameters
    ----------
    celery_app
        The Celery app whose jobs it shows (its ``exactonce_*`` settings).
    actions
        Show the buttons and accept the POST actions (cancel, reconcile, pause,
        resume);
        otherwise the pages are read-only and the actions answer 403.
    auth
        Credentials every request must carry (401 without them): a bearer
        token and/or a basic auth user and password. ``None``: none asked
        (the site it is mounted in, or the loopback bind, keeps others out).
    allowed_hosts
        The ``Host`` names it answers to (400 for others); ``None``: any.

    Raises
    ------
    ConfigurationError
        The ``web`` extra is not installed (the message has the ``pip install`` line).
    """
    require()
    from celery_exactonce.web import app

    return app.build(celery_app, actions=actions, auth=auth, allowed_hosts=allowed_hosts)
