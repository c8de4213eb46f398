"""``celery exactonce schedule add|remove|pause|resume``: the stored entries from a shell.

Each command is one call of :mod:`celery_exactonce.entries` (the same checks,
the same refusals naming the entry); every beat on the store takes the change
at its next tick.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import click

from celery_exactonce import entries
from celery_exactonce.cli import base
from celery_exactonce.core import exceptions
from celery_exactonce.schedules import at, cron


def _json(kind: type, what: str) -> Any:
    def convert(_ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
        if value is None:
            return kind()
        try:
            found = json.loads(value)
        except ValueError as exc:
            raise click.BadParameter(f"{what} is not JSON: {exc}", param=param) from None
        if not isinstance(found, kind):
            raise click.BadParameter(f"{what} must be a JSON {kind.__name__}", param=param)
        return found

    return convert


def _schedule(every: str | None, cron_expr: str | None, tz: str | None, when: str | None) -> Any:
    given = [value for value in (every, cron_expr, when) if value is not None]
    if len(given) != 1:
        raise click.UsageError("give the schedule as one of --every, --cron or --at")
    if every is not None:
        try:
            return base.parse_age(every)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--every") from None
    if cron_expr is not None:
        return cron(cron_expr, tz=tz)
    try:
        return at(datetime.fromisoformat(str(when)))
    except (ValueError, exceptions.ConfigurationError) as exc:
        raise click.BadParameter(f"{when!r}: {exc}", param_hint="--at") from None


def _echo(entry: entries.StoredEntry, what: str, as_json: bool) -> None:
    data = {
        "entry": entry.name,
        "task": entry.task,
        "schedule": entry.schedule,
        "paused": entry.paused,
        "since": base.iso(entry.since),
    }
    if as_json:
        base.emit_json({**data, "args": entry.args, "kwargs": entry.kwargs})
        return
    state = "paused" if entry.paused else f"runs from {base.short_time(entry.since)}"
    click.echo(f"stored entry {entry.name!r} {what}: {entry.task}, {entry.schedule}, {state}")


@click.command()
@click.argument("name")
@click.argument("task")
@click.option("--every", help="An interval: 30, 30s, 5m, 1h30m.")
@click.option("--cron", "cron_expr", help='A cron expression: "*/5 * * * *", "@daily".')
@click.option("--tz", help="The zone a --cron expression is read in (default: the app's).")
@click.option("--at", "when", help="One instant, ISO-8601 with its offset.")
@click.option("--args", callback=_json(list, "--args"), help="Positional arguments, a JSON list.")
@click.option("--kwargs", callback=_json(dict, "--kwargs"), help="Keyword arguments, JSON.")
@click.option(
    "--options",
    callback=_json(dict, "--options"),
    help='apply_async options and the entry\'s policy, JSON: {"queue": "q", "exactonce": {...}}.',
)
@click.option("--paused", is_flag=True, help="Store it paused.")
@base.json_option
@click.pass_context
@base.handles_errors
def add(
    ctx: click.Context,
    name: str,
    task: str,
    every: str | None,
    cron_expr: str | None,
    tz: str | None,
    when: str | None,
    args: list[Any],
    kwargs: dict[str, Any],
    options: dict[str, Any],
    paused: bool,
    as_json: bool,
) -> None:
    """Store entry NAME running TASK (replacing one of that name); beat runs it next tick."""
    sched = _schedule(every, cron_expr, tz, when)
    app = base.app_of(ctx)
    entry = entries.save(
        app, name, task, sched, args=args, kwargs=kwargs, options=options, paused=paused
    )
    _echo(entry, "saved", as_json)


@click.command()
@click.argument("name")
@base.json_option
@click.pass_context
@base.handles_errors
def remove(ctx: click.Context, name: str, as_json: bool) -> None:
    """Remove stored entry NAME: no beat fires it from its next tick."""
    if not entries.delete(base.app_of(ctx), name):
        base.fail(f"no stored entry {name!r}")
    if as_json:
        base.emit_json({"entry": name, "removed": True})
    else:
        click.echo(f"stored entry {name!r} removed")


def _pausing(paused: bool) -> click.Command:
    verb = "pause" if paused else "resume"

    @click.command(name=verb)
    @click.argument("name")
    @base.json_option
    @click.pass_context
    @base.handles_errors
    def command(ctx: click.Context, name: str, as_json: bool) -> None:
        try:
            entry = (entries.pause if paused else entries.resume)(base.app_of(ctx), name)
        except KeyError:
            base.fail(f"no stored entry {name!r}")
        _echo(entry, f"{verb}d", as_json)

    command.help = (
        "Pause stored entry NAME: no beat fires it until it is resumed."
        if paused
        else "Resume stored entry NAME from now (what fell due while paused does not run)."
    )
    return command


#: The subcommands of ``schedule``.
COMMANDS = (add, remove, _pausing(True), _pausing(False))
