"""``celery exactonce web``: serve the jobs dashboard (:mod:`celery_exactonce.web`)."""

from __future__ import annotations

import click

from celery_exactonce import runtime, web
from celery_exactonce.cli import base
from celery_exactonce.stores import redact_url
from celery_exactonce.web import server


@click.command("web")
@click.option(
    "--bind",
    metavar="ADDR",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on. Any but loopback needs auth (a token or a user).",
)
@click.option(
    "--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port."
)
@click.option(
    "--actions",
    is_flag=True,
    help="Show the buttons and accept the actions: cancel a job not dispatched yet, "
    "run a reconcile pass, pause or resume a stored entry. Without it the dashboard "
    "is read-only.",
)
@click.option(
    "--token",
    metavar="TOKEN",
    envvar=server.TOKEN_VARIABLE,
    help=f"Bearer token every request must carry (or basic auth's password); "
    f"better set as {server.TOKEN_VARIABLE}, which a process list does not show.",
)
@click.option(
    "--user",
    metavar="USER",
    envvar=server.USER_VARIABLE,
    help=f"Basic auth user (or {server.USER_VARIABLE}), with {server.PASSWORD_VARIABLE}.",
)
@click.option(
    "--password",
    metavar="PASSWORD",
    envvar=server.PASSWORD_VARIABLE,
    help=f"Basic auth password; better set as {server.PASSWORD_VARIABLE}.",
)
@click.option(
    "--root-path",
    metavar="PATH",
    default="",
    help="The path a reverse proxy serves the dashboard under (/exactonce), for its links.",
)
@click.pass_context
@base.handles_errors
def web_command(
    ctx: click.Context,
    bind: str,
    port: int,
    actions: bool,
    token: str | None,
    user: str | None,
    password: str | None,
    root_path: str,
) -> None:
    """Serve the jobs dashboard: jobs, one job's history, beat entries, the store's health.

    Bound to 127.0.0.1 unless told otherwise; any other address needs auth
    (EXACTONCE_WEB_TOKEN, or EXACTONCE_WEB_USER and EXACTONCE_WEB_PASSWORD).
    Needs the web extra: pip install 'celery-exactonce[web]'. docs/howto/dashboard.md
    shows each page.
    """
    try:
        auth = web.Auth(token=token, user=user, password=password)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    server.check_bind(bind, auth)
    web.require("starlette", "jinja2", "uvicorn")
    app = base.app_of(ctx)
    rt = runtime.runtime_for(app, setup=False)
    if rt.store.schema_version() is None:
        base.fail(
            f"the store {redact_url(rt.config.store_url)} was never set up: a worker or beat "
            "sets it up at start, or run `celery -A APP exactonce migrate`"
        )
    hosts = None if auth.configured else web.security.loopback_hosts(bind)
    dashboard = web.create_app(app, actions=actions, auth=auth, allowed_hosts=hosts)
    host, prefix = (f"[{bind}]" if ":" in bind else bind), root_path.rstrip("/")
    click.echo(
        f"celery-exactonce dashboard on http://{host}:{port}{prefix}/ for namespace "
        f"{rt.config.namespace!r} of {redact_url(rt.config.store_url)}; "
        f"actions {'on' if actions else 'off'}; auth {'on' if auth.configured else 'off'}"
    )
    server.serve(dashboard, bind=bind, port=port, root_path=prefix)
