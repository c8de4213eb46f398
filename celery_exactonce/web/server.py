"""Serving the dashboard with uvicorn: what ``celery exactonce web`` runs.

:func:`check_bind` refuses a bind address that is not this machine's alone
when no credential is configured; :func:`serve` runs uvicorn in this process
(one process, no reload) until it is stopped (SIGINT, SIGTERM).
"""

from __future__ import annotations

from typing import Any

from celery_exactonce.core import exceptions
from celery_exactonce.web import require, security

#: Environment variables of the credentials (the options' values; never printed).
TOKEN_VARIABLE = "EXACTONCE_WEB_TOKEN"  # noqa: S105 (a name, not a secret)
USER_VARIABLE = "EXACTONCE_WEB_USER"
PASSWORD_VARIABLE = "EXACTONCE_WEB_PASSWORD"  # noqa: S105


def check_bind(bind: str, auth: security.Auth) -> None:
    """Raise ``ConfigurationError`` when ``bind`` is not loopback and ``auth`` asks nothing."""
    if auth.configured or security.is_loopback(bind):
        return
    raise exceptions.ConfigurationError(
        f"refusing to serve the dashboard on {bind}, which is not this machine alone, "
        f"without auth: set {TOKEN_VARIABLE} (or --user and {PASSWORD_VARIABLE}), "
        "or bind 127.0.0.1"
    )


def serve(app: Any, *, bind: str, port: int, root_path: str = "", log_level: str = "info") -> None:
    """Serve ``app`` on ``bind``:``port`` with uvicorn until stopped.

    ``root_path``: the path a reverse proxy serves it under, for its links.

    Raises ``ConfigurationError`` (with the ``pip install`` line) without uvicorn.
    """
    require("uvicorn")
    import uvicorn

    config = uvicorn.Config(
        app,
        host=bind,
        port=port,
        log_level=log_level,
        root_path=root_path,
        server_header=False,
        lifespan="off",
    )
    uvicorn.Server(config).run()
