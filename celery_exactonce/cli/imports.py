"""``celery exactonce import redbeat``: RedBeat's entries moved into stored entries.

The migration: stop RedBeat's beats, run this, start ours. Each RedBeat entry
(from its settings or saved at run time, enabled or not) becomes a stored
entry with its task, schedule, arguments and options, paused if it was
disabled, its slots starting just after the ``last_run_at`` RedBeat kept
(:mod:`celery_exactonce.contrib.redbeat`): the slot RedBeat ran last never
runs again. Slots RedBeat missed while it was stopped are the catch-up
policy's when they are inside ``exactonce_window_lookback`` (our beats run
or skip them, counting what they skip); older ones are counted here, in the
store's record of skipped slots (reason ``import``), and printed. What cannot
be imported is printed with why, and the others are imported all the same.
``--dry-run`` prints the same and writes nothing.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import click

from celery_exactonce import entries, runtime
from celery_exactonce.beat import stored
from celery_exactonce.cli import base
from celery_exactonce.contrib import redbeat as redbeat_entries
from celery_exactonce.core import exceptions, slots
from celery_exactonce.core.skipped_slots import SkippedSlots
from celery_exactonce.stores import redact_url

#: The ``where`` of the slots an import counts as missed (older than the look-back).
MISSED = "import"
#: Most missed slots counted per entry (a count that reaches it says "at least").
MISSED_LIMIT = 100_000


@click.group(name="import")
def import_() -> None:
    """Move entries in from another scheduler."""


@import_.command()
@click.option(
    "--redis-url",
    metavar="URL",
    help="RedBeat's Redis (default: redbeat_redis_url, else broker_url).",
)
@click.option(
    "--key-prefix",
    metavar="PREFIX",
    help="RedBeat's key prefix (default: redbeat_key_prefix, else 'redbeat:').",
)
@click.option("--dry-run", is_flag=True, help="Print what would be imported; write nothing.")
@base.json_option
@click.pass_context
@base.handles_errors
def redbeat(
    ctx: click.Context, redis_url: str | None, key_prefix: str | None, dry_run: bool, as_json: bool
) -> None:
    """Store RedBeat's entries as stored entries (stop RedBeat's beats first)."""
    import redis

    app = base.app_of(ctx)
    url = redis_url or app.conf.get("redbeat_redis_url") or app.conf.broker_url
    prefix = key_prefix or app.conf.get("redbeat_key_prefix") or redbeat_entries.DEFAULT_PREFIX
    store = runtime.runtime_for(app).store
    now = store.now()
    settings = dict(app.conf.beat_schedule or {})
    try:
        with redis.Redis.from_url(url) as client:
            found = list(redbeat_entries.read(client, prefix))
    except redis.RedisError as exc:
        base.fail(f"RedBeat's Redis {redact_url(url)} cannot be read: {base.one_line(exc)}")
    planned = [redbeat_entries.plan(f, settings, now) for f in found]
    rows, specs, missed = [], [], []
    lookback = timedelta(seconds=runtime.config_for(app).window_lookback)
    candidates = [(p, p.spec) for p in planned if p.spec is not None]
    verdicts = dict(
        zip(
            [id(p) for p, _ in candidates],
            entries.check(app, [s for _, s in candidates]),
            strict=True,
        )
    )
    existing = set(store.read_entries()[1])
    for p in planned:
        row: dict[str, Any] = {"entry": p.found.name, "key": p.found.key, "static": p.found.static}
        rows.append(row)
        entry = verdicts.get(id(p))
        if isinstance(entry, exceptions.ConfigurationError):
            row.update(imported=False, why=base.one_line(entry))
            continue
        if p.spec is None or entry is None:
            row.update(imported=False, why=p.why_not)
            continue
        specs.append(p.spec)
        row.update(imported=True, task=entry.task, schedule=entry.schedule, paused=entry.paused)
        row.update(since=base.iso(entry.since), replaces=entry.name in existing)
        if p.found.last_run_at is not None and not entry.paused:
            old = _missed(app, entry, now - lookback)
            if old:
                missed.append(SkippedSlots(entry.name, MISSED, old[0], old[-1], len(old), "import"))
                row["missed_older_than_lookback"] = len(old)
    if not dry_run and specs:
        entries.save_many(app, specs)
        if missed:
            store.note_skipped(missed)
    _report(rows, dry_run, as_json)


def _missed(app: Any, entry: entries.StoredEntry, until: datetime) -> list[datetime]:
    """The entry's slots after its start and before the look-back: beyond catch-up."""
    if entry.since >= until:
        return []
    sched = stored.decode_schedule(entry.name, entry.schedule)
    zone = ZoneInfo(str(app.timezone))
    return slots.slots_between(
        sched, entry.since, until, tz=zone, limit=MISSED_LIMIT, entry=entry.name
    )


def _report(rows: list[dict[str, Any]], dry_run: bool, as_json: bool) -> None:
    if as_json:
        base.emit_json({"dry_run": dry_run, "entries": rows})
        return
    done = sum(1 for row in rows if row["imported"])
    verb = "would be imported" if dry_run else "imported"
    click.echo(f"{done} of {len(rows)} RedBeat entr(y/ies) {verb}")
    table = []
    for row in rows:
        if row["imported"]:
            state = "paused" if row["paused"] else f"from {row['since']}"
            missed = row.get("missed_older_than_lookback")
            least = "at least " if missed == MISSED_LIMIT else ""
            note = (
                f"{least}{missed} slot(s) missed, older than the look-back: counted"
                if missed
                else ""
            )
            if row["replaces"]:
                note = "; ".join(filter(None, ["replaces the stored entry of this name", note]))
            table.append([row["entry"], row["task"], row["schedule"], state, note])
        else:
            table.append([row["entry"], "-", "-", "not imported", row["why"]])
    click.echo(base.table(["entry", "task", "schedule", "slots", "note"], table))
