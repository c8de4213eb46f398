"""``celery exactonce reconcile``, ``cancel`` and ``migrate``: the commands that write."""

from __future__ import annotations

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
        task_id = resolve(s.store, task_id)
        runtime.install(s.app, s.store, s.config)
        cancelled = cancelling.cancel(task_id, s.app)
        job = s.store.get(JobRef.submitted(task_id))
        others = [j for j in find_job(s.store, task_id) if j.ref.space is Space.OCCURRENCE]
    state = None if job is None else job.state.value
    already = not cancelled and job is not None and job.state is State.CANCELLED
    data: dict[str, Any] = {
        "task_id": task_id,
        "cancelled": cancelled,
        "already_cancelled": already,
        "state": state,
    }
    if as_json:
        base.emit_json(data)
    elif cancelled:
        click.echo(f"cancelled {task_id}: it will not run")
    elif already:
        click.echo(f"{task_id} was cancelled already (CANCELLED): it will not run")
    if cancelled or already:
        return
    if job is None and others:
        base.fail(
            f"{task_id!r} is a beat occurrence ({others[0].state.value}): "
            "only submitted jobs cancel"
        )
    if job is None:
        base.fail(f"no job {task_id!r} in namespace {s.config.namespace!r}")
    base.fail(
        f"{task_id!r} is {state}: only a job not dispatched yet (PENDING, SCHEDULED) cancels"
        + ("; revoke a dispatched one with `celery control revoke`" if not job.terminal else "")
    )


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
