"""``celery exactonce probe beat|worker``: ask a beat or worker on this host whether it is live.

For a Kubernetes ``exec`` probe or a container's ``HEALTHCHECK`` (which
needs no ``curl`` in the image): it asks the process's ``/healthz``
(``--ready``: ``/readyz``) on the port its settings give
(``exactonce_metrics_port`` for beat, ``exactonce_worker_metrics_port`` for a
worker), prints the answer and exits 0 when the check holds, 1 when it does
not or nothing answers. What each answer means:
:mod:`celery_exactonce.observe.health`. Nothing is read from the store here.
"""

from __future__ import annotations

import http.client
import ipaddress
from typing import Any

import click

from celery_exactonce import runtime
from celery_exactonce.cli import base
from celery_exactonce.observe.health import LIVE_PATH, READY_PATH

#: The setting that gives each role's port.
PORT_SETTINGS = {"beat": "exactonce_metrics_port", "worker": "exactonce_worker_metrics_port"}


@click.command("probe")
@click.argument("role", type=click.Choice(sorted(PORT_SETTINGS)))
@click.option("--ready", is_flag=True, help="Readiness (/readyz) instead of liveness (/healthz).")
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    help="The port to ask (default: the role's setting, exactonce_metrics_port or "
    "exactonce_worker_metrics_port).",
)
@click.option(
    "--host",
    metavar="HOST",
    help="The host to ask (default: exactonce_metrics_addr, or this host's loopback "
    "when that is every interface).",
)
@click.option(
    "--timeout",
    type=click.FloatRange(0, min_open=True),
    default=2.0,
    show_default=True,
    help="Seconds to wait for the answer.",
)
@base.json_option
@click.pass_context
@base.handles_errors
def probe(
    ctx: click.Context,
    role: str,
    ready: bool,
    port: int | None,
    host: str | None,
    timeout: float,
    as_json: bool,
) -> None:
    """Ask a beat or worker on this host whether it is live (exit 0) or not (exit 1).

    ROLE is beat or worker. With --ready: whether it is ready (beat: its last
    tick reached the store; a worker: connected to the broker, the store
    answers).
    """
    obj = ctx.find_root().obj
    app = getattr(obj, "app", None) or base.app_of(ctx)
    settings = runtime.config_for(app)  # validated; the store is not opened
    setting = PORT_SETTINGS[role]
    port = port or getattr(settings, setting.removeprefix("exactonce_"))
    if port is None:
        click.echo(
            f"celery-exactonce: error: {setting} is not set: the {role} serves no probe "
            f"(set it, or pass --port)",
            err=True,
        )
        ctx.exit(base.EXIT_USAGE)
    path = READY_PATH if ready else LIVE_PATH
    for tried in [host] if host else _loopbacks_for(settings.metrics_addr):
        status, answer = _ask(tried, port, path, timeout)
        if status is not None:
            break
    ok = status == 200
    where = f"{_bracketed(tried)}:{port}{path}"
    if as_json:
        base.emit_json(
            {"ok": ok, "role": role, "probe": "ready" if ready else "live", "url": where,
             "status": status, "answer": answer}
        )  # fmt: skip
    else:
        click.echo(f"{role} {'readiness' if ready else 'liveness'} ({where}): {answer}")
    ctx.exit(base.EXIT_OK if ok else base.EXIT_FAILED)


def _loopbacks_for(addr: str) -> list[str]:
    """Where to reach a server bound to ``addr`` from this host, in the order to try."""
    if addr in ("", "0.0.0.0"):  # noqa: S104 (every interface: reached on loopback)
        return ["127.0.0.1"]
    if addr == "::":  # IPv4 too, and a container's loopback may have no IPv6
        return ["127.0.0.1", "::1"]
    return [addr]


def _bracketed(host: str) -> str:
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:  # a name
        return host


def _ask(host: str, port: int, path: str, timeout: float) -> tuple[int | None, str]:
    """The status and first line of ``GET path``; ``None`` and why when nothing answered."""
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("GET", path)
        response: Any = connection.getresponse()
        text = response.read(4096).decode("utf-8", "replace").strip()
        status = int(response.status)
    except (OSError, http.client.HTTPException) as exc:
        return None, f"failing: nothing answers: {base.one_line(exc) or type(exc).__name__}"
    finally:
        connection.close()
    if status not in (200, 503):  # not our endpoint (another server on the port)
        return status, f"failing: HTTP {status} from {path}: is this port the {path} of ours?"
    return status, text.splitlines()[0] if text else f"HTTP {status}"
