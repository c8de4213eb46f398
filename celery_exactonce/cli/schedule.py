"""``celery exactonce schedule``: each beat entry's next slots and last dispatched occurrence;
``schedule add|remove|pause|resume``: the stored entries (:mod:`celery_exactonce.entries`).

The slots are the ones every beat node computes (:mod:`celery_exactonce.core.slots`,
on the store's clock and the app's time zone); the last occurrence is the job
of the entry's watermark, the newest slot any node claimed.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any
from zoneinfo import ZoneInfo

import click

from celery_exactonce.cli import base, stored_entries
from celery_exactonce.cli.entries import Entry, beat_entries, with_last
from celery_exactonce.core import slots
from celery_exactonce.schedules import bounded


def schedule_data(s: base.Session, count: int) -> dict[str, Any]:
    now = s.store.now()
    tz = ZoneInfo(str(s.app.timezone))
    rows = []
    for e, mark, job in with_last(s.store, beat_entries(s.app, s.config, s.store)):
        upcoming: list[str | None] = []
        error = e.error
        if e.entry is not None and not e.paused:
            try:
                found = slots.slots_between(
                    e.entry.schedule,
                    now,
                    now + timedelta(days=slots.SEARCH_DAYS),
                    tz=tz,
                    limit=count,
                    entry=e.name,
                )
                upcoming = [base.iso(slot) for slot in found]
            except Exception as exc:  # beat refuses such an entry: say why, show the rest
                error = f"{type(exc).__name__}: {base.one_line(exc)}"
        rows.append(
            {
                "entry": e.name,
                "task": e.task,
                "source": e.source,
                "paused": e.paused,
                "schedule": None if e.entry is None else _shown(e),
                "next": upcoming,
                "last_claimed": base.iso(mark),
                "last_state": None if job is None else job.state.value,
                "last_task_id": None if job is None else job.ref.id,
                "last_node": None if job is None else job.node,
                "error": error,
            }
        )
    return {"store_time": base.iso(now), "timezone": str(tz), "entries": rows}


def _shown(e: Entry) -> str:
    """The entry's schedule as its definition says it (a stored one's, without its start)."""
    assert e.entry is not None  # noqa: S101 (the caller checked)
    sched = e.entry.schedule
    if e.source == "stored" and isinstance(sched, bounded):
        sched = sched.schedule
    return base.unwrapped(str(sched))


@click.group(invoke_without_command=True)
@click.option(
    "--count",
    type=click.IntRange(1, 100),
    default=3,
    show_default=True,
    help="Next slots shown per entry.",
)
@base.json_option
@click.pass_context
@base.handles_errors
def schedule(ctx: click.Context, count: int, as_json: bool) -> None:
    """Each beat entry's next slots and its last claimed occurrence.

    The entries of ``beat_schedule``, the stored ones and beat's own; with
    ``beat_scheduler = "exactonce-django"``, django-celery-beat's enabled rows
    instead of stored ones. ``add``, ``remove``, ``pause`` and ``resume`` change
    the stored entries, which every beat takes at its next tick.
    """
    if ctx.invoked_subcommand is not None:
        return
    with base.session(ctx) as s:
        data = schedule_data(s, count)
    if as_json:
        base.emit_json(data)
        return
    click.echo(f"store time {data['store_time']}, time zone {data['timezone']}")
    rows = []
    for e in data["entries"]:
        nxt = e["next"][0] if e["next"] else None
        last = e["last_claimed"] and f"{e['last_claimed']} {e['last_state'] or '(purged)'}"
        note = "paused" if e["paused"] else e["error"]
        rows.append([e["entry"], e["task"], e["schedule"], nxt, last, note])
        rows.extend(["", "", "", later, "", ""] for later in e["next"][1:])
    click.echo(base.table(["entry", "task", "schedule", "next", "last claimed", "error"], rows))


for _command in stored_entries.COMMANDS:
    schedule.add_command(_command)
