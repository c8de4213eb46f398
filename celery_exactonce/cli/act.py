"""``celery exactonce reconcile``, ``cancel`` and ``migrate``: the commands that write."""

from __future__ import annotations

import dataclasses
from typing import Any

import click

from celery_exactonce import runtime
from celery_exactonce.cli import base
from celery_exactonce.cli.inspect import find_job, resolve
from celery_exactonce.core.refs import JobRef, Space
from celery_exactonce.core.states import State
from celery_exactonce.reconcile import cancel as cancelling
from celery_exactonce.reconcile.reconciler import Reconciler
from celery_exactonce.stores import redact_url
from celery_exactonce.stores.base import format_written


@click.command()
@base.json_option
@click.pass_context
@base.handles_errors
def reconcile(ctx: click.Context, as_json: bool) -> None:
    """Run one reconciler pass now and print its report.

    The pass takes the reconciler's lease like any other: when another node
    holds it, nothing runs (``ran: false``) and the exit status is 1. On a
    sharded store the lease is each shard's: the pass reconciles the shards
    it takes and skips those another node holds (``held_elsewhere``); it runs
    unless every shard is held.
    """
    with base.session(ctx) as s:
        rt = runtime.install(s.app, s.store, s.config)  # signs what it writes, as nodes do
        report = Reconciler(rt).run_pass()
    data = report.as_dict()
    if as_json:
        base.emit_json({**data, "summary": report.summary()})
    else:
        click.echo(base.pairs([(k, v) for k, v in data.items() if k != "stale"]))
        click.echo(f"  stale listed: {data['stale'] or '-'}")
        click.echo(f"pass: {report.summary()}")
    if not report.ran:
        base.fail("the pass did not run: another node holds the reconciler's lease")
    if report.errors:
        base.fail(f"the pass met {report.errors} store error(s): see the log")


@dataclasses.dataclass(frozen=True)
class Cancelled:
    """What cancelling a job did (:func:`cancel_job`): the CLI's ``cancel`` and the dashboard's."""

    task_id: str
    """The whole id (a prefix given was resolved)."""
    cancelled: bool
    """This call ended the job ``CANCELLED``."""
    already: bool
    """It was ``CANCELLED`` before: it will not run either."""
    state: str | None
    """The job's state after the call (``None``: no such submitted job)."""
    refusal: str | None
    """Why it was not cancelled (``None`` when it will not run)."""

    def as_dict(self) -> dict[str, Any]:
        """The ``cancel --json`` document."""
        return {
            "task_id": self.task_id,
            "cancelled": self.cancelled,
            "already_cancelled": self.already,
            "state": self.state,
        }


def cancel_job(s: base.Session, task_id: str) -> Cancelled:
    """Cancel the submitted job ``task_id`` (or the one id it starts) if not dispatched yet.

    Writes through :func:`celery_exactonce.cancel` on the app's runtime, which
    must be on ``s.store`` (the CLI installs it; the dashboard's session is
    the runtime's). Raises ``click.BadParameter`` for an ambiguous prefix,
    ``StoreError`` when the store cannot be written.
    """
    task_id = resolve(s.store, task_id)
    cancelled = cancelling.cancel(task_id, s.app)
    job = s.store.get(JobRef.submitted(task_id))
    others = [j for j in find_job(s.store, task_id) if j.ref.space is Space.OCCURRENCE]
    state = None if job is None else job.state.value
    already = not cancelled and job is not None and job.state is State.CANCELLED
    refusal = None
    if cancelled or already:
        pass
    elif job is None and others:
        refusal = (
            f"{task_id!r} is a beat occurrence ({others[0].state.value}): "
            "only submitted jobs cancel"
        )
    elif job is None:
        refusal = f"no job {task_id!r} in namespace {s.config.namespace!r}"
    else:
        refusal = (
            f"{task_id!r} is {state}: only a job not dispatched yet (PENDING, SCHEDULED) cancels"
            + ("; revoke a dispatched one with `celery control revoke`" if not job.terminal else "")
        )
    return Cancelled(task_id, cancelled, already, state, refusal)


@click.command()
@click.argument("task_id", callback=base.validate_task_id)
@base.json_option
@click.pass_context
@base.handles_errors
def cancel(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """Cancel the job TASK_ID if it has not been dispatched yet (exit 1 if it was).

    A delayed job still waiting (``PENDING``), or one claimed but not
    published (``SCHEDULED``), ends ``CANCELLED`` and never runs. A job
    cancelled already is left so, and the command succeeds: it will not run.
    A dispatched job is left as it is: revoke it with ``celery control revoke``.
    TASK_ID may be the start of an id, as long as no other job's id starts with it.
    """
    with base.session(ctx) as s:
        runtime.install(s.app, s.store, s.config)
        done = cancel_job(s, task_id)
    if as_json:
        base.emit_json(done.as_dict())
    elif done.cancelled:
        click.echo(f"cancelled {done.task_id}: it will not run")
    elif done.already:
        click.echo(f"{done.task_id} was cancelled already (CANCELLED): it will not run")
    if done.refusal is not None:
        base.fail(done.refusal)


@click.command()
@base.json_option
@click.pass_context
@base.handles_errors
def migrate(ctx: click.Context, as_json: bool) -> None:
    """Create or upgrade the store's schema now (what a node does at start). Idempotent."""
    with base.session(ctx, set_up=False) as s:
        before = s.store.schema_version()
        s.store.setup()
        after = s.store.schema_version()
    data = {
        "store": redact_url(s.config.store_url),
        "namespace": s.config.namespace,
        "before": before,
        "after": after,
        "format": format_written(s.store),
    }
    if as_json:
        base.emit_json(data)
    elif before == after:
        click.echo(f"{data['store']}: already at format {after}, nothing to do")
    else:
        click.echo(f"{data['store']}: format {before or '(none)'} -> {after}")
