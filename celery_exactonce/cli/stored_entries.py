"""``celery exactonce schedule add|remove|pause|resume``: the stored entries from a shell.

Each command is one call of :mod:`celery_exactonce.entries` (the same checks,
the same refusals naming the entry); every beat on the store takes the change
at its next tick.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import IO, Any

import click

from celery_exactonce import entries, runtime
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


def _schedule(
    every: object, cron_expr: object, tz: object, when: object, *, where: str = ""
) -> Any:
    """The schedule the options (or a ``--file`` entry's fields) give; a usage error else."""
    given = [value for value in (every, cron_expr, when) if value is not None]
    if len(given) != 1:
        raise click.UsageError("give the schedule as one of --every, --cron or --at")
    if tz is not None and cron_expr is None:
        raise click.UsageError("--tz is the zone of a --cron expression: give it with --cron")
    if every is not None:
        try:
            return base.parse_age(str(every))
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint=where or "--every") from None
    if cron_expr is not None:
        return cron(str(cron_expr), tz=None if tz is None else str(tz))
    try:
        return at(datetime.fromisoformat(str(when)))
    except (ValueError, exceptions.ConfigurationError) as exc:
        raise click.BadParameter(f"{when!r}: {exc}", param_hint=where or "--at") from None


def _data(entry: entries.StoredEntry) -> dict[str, Any]:
    return {
        "entry": entry.name,
        "task": entry.task,
        "schedule": entry.schedule,
        "args": entry.args,
        "kwargs": entry.kwargs,
        "options": entry.options,
        "paused": entry.paused,
        "since": base.iso(entry.since),
    }


def _echo(entry: entries.StoredEntry, what: str, as_json: bool) -> None:
    if as_json:
        base.emit_json(_data(entry))
        return
    state = "paused" if entry.paused else f"runs from {base.short_time(entry.since)}"
    click.echo(f"stored entry {entry.name!r} {what}: {entry.task}, {entry.schedule}, {state}")


@click.command()
@click.argument("name", required=False)
@click.argument("task", required=False)
@click.option("--every", metavar="DURATION", help="An interval: 30, 30s, 5m, 1h30m.")
@click.option(
    "--cron", "cron_expr", metavar="EXPR", help='A cron expression: "*/5 * * * *", "@daily".'
)
@click.option(
    "--tz", metavar="ZONE", help="The zone a --cron expression is read in (default: the app's)."
)
@click.option("--at", "when", metavar="WHEN", help="One instant, ISO-8601 with its offset.")
@click.option(
    "--args",
    metavar="JSON",
    callback=_json(list, "--args"),
    help="Positional arguments, a JSON list.",
)
@click.option(
    "--kwargs", metavar="JSON", callback=_json(dict, "--kwargs"), help="Keyword arguments, JSON."
)
@click.option(
    "--options",
    metavar="JSON",
    callback=_json(dict, "--options"),
    help='apply_async options and the entry\'s policy, JSON: {"queue": "q", "exactonce": {...}}.',
)
@click.option("--paused", is_flag=True, help="Store it paused.")
@click.option(
    "--file",
    "from_file",
    type=click.File("r"),
    metavar="PATH",
    help="Save the entries of a JSON list instead, each an object of these options' names "
    '(name, task, every, cron, tz, at, args, kwargs, options, paused); "-" reads stdin. '
    "All are checked before any is saved.",
)
@base.json_option
@click.pass_context
@base.handles_errors
def add(
    ctx: click.Context,
    name: str | None,
    task: str | None,
    every: str | None,
    cron_expr: str | None,
    tz: str | None,
    when: str | None,
    args: list[Any],
    kwargs: dict[str, Any],
    options: dict[str, Any],
    paused: bool,
    from_file: IO[str] | None,
    as_json: bool,
) -> None:
    """Store entry NAME running TASK (replacing one of that name); beat runs it next tick.

    The schedule is one of --every, --cron (with --tz) or --at. With --file,
    the entries of a JSON list instead of NAME and TASK.
    """
    if from_file is not None:
        if name is not None or task is not None:
            raise click.UsageError("give NAME and TASK, or --file, not both")
        specs = _specs(from_file)
    else:
        if name is None or task is None:
            raise click.UsageError("give NAME and TASK (or --file)")
        sched = _schedule(every, cron_expr, tz, when)
        fields = {"args": args, "kwargs": kwargs, "options": options, "paused": paused}
        specs = [{"name": name, "task": task, "schedule": sched, **fields}]
    as_json = base.wants_json(ctx, as_json)
    saved = entries.save_many(base.app_of(ctx), specs)
    if as_json and from_file is not None:
        base.emit_json({"saved": [_data(entry) for entry in saved]})
        return
    for entry in saved:
        _echo(entry, "saved", as_json)


def _specs(source: IO[str]) -> list[dict[str, Any]]:
    """The entries of a ``--file``: each one's schedule read as the options read it."""
    try:
        items = json.load(source)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--file") from None
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise click.BadParameter("must be a JSON list of objects", param_hint="--file")
    specs = []
    for i, item in enumerate(items):
        spec = dict(item)
        where = f"--file, entry {spec.get('name', i)!r}"
        try:
            spec["schedule"] = _schedule(
                *(spec.pop(key, None) for key in ("every", "cron", "tz", "at")), where=where
            )
        except click.UsageError as exc:
            raise click.UsageError(f"{where}: {exc.message}") from None
        specs.append(spec)
    return specs


def _names(verb: str, doc: str) -> click.Command:
    """``remove``, ``pause`` or ``resume`` of each of NAMES (all must exist; none is changed
    when one does not)."""

    @click.command(name=verb, help=doc)
    @click.argument("names", nargs=-1, required=True)
    @base.json_option
    @click.pass_context
    @base.handles_errors
    def command(ctx: click.Context, names: tuple[str, ...], as_json: bool) -> None:
        as_json = base.wants_json(ctx, as_json)
        app = base.app_of(ctx)
        listed = entries.list_stored(app)
        unreadable = [str(listed[n]) for n in names if isinstance(listed.get(n), Exception)]
        if verb != "remove" and unreadable:  # remove takes those too
            base.fail(f"{unreadable[0]}: nothing changed (remove it, or save it again)")
        if missing := [name for name in names if name not in listed]:
            base.fail(
                f"no stored entry {missing[0]!r}" + (f" (nor {missing[1:]})" if missing[1:] else "")
            )
        done: list[dict[str, Any]] = []
        for name in dict.fromkeys(names):
            if verb == "remove":
                entries.delete(app, name)
                done.append({"entry": name, "removed": True})
                if not as_json:
                    click.echo(f"stored entry {name!r} removed")
                continue
            entry = (entries.pause if verb == "pause" else entries.resume)(app, name)
            done.append(_data(entry))
            if not as_json:
                _echo(entry, f"{verb}d", False)
        if as_json:
            base.emit_json(done[0] if len(done) == 1 else {"entries": done})

    return command


@click.command()
@base.json_option
@click.pass_context
@base.handles_errors
def resign(ctx: click.Context, as_json: bool) -> None:
    """Sign every stored entry again with the first of exactonce_signing_key's keys.

    After a key rotation put the new key first, and before the old one is dropped:
    an entry signed with a key no longer configured is refused by every beat.
    """
    as_json = base.wants_json(ctx, as_json)
    app = base.app_of(ctx)
    if not runtime.config_for(app).signing_key:
        base.fail("exactonce_signing_key is not set: nothing is signed")
    written = entries.resign(app)
    if as_json:
        base.emit_json({"resigned": written})
    else:
        click.echo(f"{len(written)} stored entr(y/ies) signed again with the first key")


#: The subcommands of ``schedule``.
COMMANDS = (
    add,
    _names("remove", "Remove the stored entries NAMES: no beat fires them from its next tick."),
    _names("pause", "Pause the stored entries NAMES: no beat fires them until resumed."),
    _names(
        "resume",
        "Resume the stored entries NAMES from now (what fell due while paused does not run).",
    ),
    resign,
)
