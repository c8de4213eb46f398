"""``celery exactonce status``, ``jobs`` and ``show``: what the store holds, read only."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import click

from celery_exactonce.cli import base
from celery_exactonce.cli.entries import beat_entries, with_last
from celery_exactonce.core import exceptions, times
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.skipped_slots import merged
from celery_exactonce.core.states import State
from celery_exactonce.reconcile import passes
from celery_exactonce.reconcile.reconciler import LEASE_NAME
from celery_exactonce.reconcile.task import RECONCILE_TASK
from celery_exactonce.stores import redact_url
from celery_exactonce.stores.base import StateStore, partitions_of

#: The live states whose oldest job ``status`` shows.
WATCHED = (State.PENDING, State.SCHEDULED, State.DISPATCHED, State.RUNNING)
#: Most jobs ``jobs`` lists in one page.
MAX_LIMIT = 1000


# -- status -------------------------------------------------------------------------------


def _oldest(store: StateStore, now: datetime) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for state in WATCHED:
        found = store.list_stale(state, 0, 1)
        out[state.value] = None if not found else base.job_json(found[0], now)
    return out


def _entry_rows(s: base.Session) -> list[dict[str, Any]]:
    rows = []
    for e, mark, job in with_last(s.store, beat_entries(s.app, s.config, s.store)):
        rows.append(
            {
                "entry": e.name,
                "task": e.task,
                "watermark": base.iso(mark),
                "last_state": None if job is None else job.state.value,
                "last_node": None if job is None else job.node,
                "last_reason": None if job is None else job.reason,
                "error": e.error,
            }
        )
    return rows


def _leases(store: StateStore) -> list[dict[str, Any]]:
    """Who holds the reconciler's lease, per partition (per shard on a sharded store)."""
    rows = []
    for shard, part in enumerate(partitions_of(store)):
        held = part.lease(LEASE_NAME)
        rows.append(
            {
                "shard": shard,
                "holder": None if held is None else passes.lease_holder(held[0]) or "(unknown)",
                "expires": None if held is None else held[1],
            }
        )
    return rows


def _reconciler(store: StateStore, entries: list[dict[str, Any]]) -> dict[str, Any]:
    leases = _leases(store)
    held = [row for row in leases if row["holder"] is not None]
    own = next((row for row in entries if row["entry"] == RECONCILE_TASK), None)
    last = None
    if own is not None and own["watermark"] is not None:
        last = {
            "slot": own["watermark"],
            "state": own["last_state"],
            "node": own["last_node"],
            "reason": own["last_reason"],
        }
    return {
        # Every node holding it somewhere, and the latest expiry: on one slot, its holder.
        "lease_holder": ", ".join(dict.fromkeys(row["holder"] for row in held)) or None,
        "lease_expires": base.iso(max(row["expires"] for row in held)) if held else None,
        "leases": [{**row, "expires": base.iso(row["expires"])} for row in leases],
        "last_pass": last,
    }


def status_data(s: base.Session) -> dict[str, Any]:
    now = s.store.now()
    entries = _entry_rows(s)
    return {
        "store": redact_url(s.config.store_url),
        "namespace": s.config.namespace,
        "store_time": base.iso(now),
        "jobs": {state.value: n for state, n in s.store.count_by_state().items()},
        "oldest": _oldest(s.store, now),
        "entries": entries,
        "skipped": [
            {
                **r.to_json(),
                "first": base.iso(r.first),
                "last": base.iso(r.last),
                "at": base.iso(r.at),
            }
            for r in merged(s.store.skipped(limit=20 * 4))[:20]
        ],
        "reconciler": _reconciler(s.store, entries),
    }


def _print_status(data: dict[str, Any]) -> None:
    click.echo(
        base.pairs(
            [
                ("store", data["store"]),
                ("namespace", data["namespace"]),
                ("store time", data["store_time"]),
            ]
        )
    )
    click.echo("\njobs per state")
    click.echo(base.table(["state", "jobs"], [[k, v] for k, v in data["jobs"].items()]))
    click.echo("\noldest live jobs (by last touch)")
    click.echo(
        base.table(
            ["state", "task id", "task", "age", "node"],
            [
                [state, job["task_id"], job["task"], base.duration(job["age"]), job["node"]]
                for state, job in data["oldest"].items()
                if job is not None
            ],
        )
    )
    click.echo("\nbeat entries")
    click.echo(
        base.table(
            ["entry", "task", "watermark", "last state", "last node"],
            [
                [e["entry"], e["task"], e["watermark"], e["last_state"], e["last_node"]]
                for e in data["entries"]
            ],
        )
    )
    click.echo("\nskipped slots (newest first)")
    click.echo(
        base.table(
            ["entry", "why", "slots", "first", "last", "node"],
            [
                [r["entry"], r["where"], r["count"], r["first"], r["last"], r["node"]]
                for r in data["skipped"]
            ],
        )
    )
    rec = data["reconciler"]
    last = rec["last_pass"] or {}
    shards = rec["leases"] if len(rec["leases"]) > 1 else []
    click.echo("\nreconciler")
    click.echo(
        base.pairs(
            [
                ("lease holder", rec["lease_holder"] or "(free)"),
                ("lease expires", rec["lease_expires"]),
                *((f"lease of shard {row['shard']}", row["holder"] or "(free)") for row in shards),
                ("last pass slot", last.get("slot")),
                ("last pass", f"{last.get('state')} on {last.get('node')}" if last else None),
                ("last pass said", last.get("reason")),
            ]
        )
    )


@click.command()
@base.json_option
@click.pass_context
@base.handles_errors
def status(ctx: click.Context, as_json: bool) -> None:
    """Jobs per state, the oldest live jobs, each beat entry's watermark and last
    occurrence, skipped slots, the reconciler's lease holder (each shard's, on a
    sharded store) and last pass."""
    with base.session(ctx) as s:
        data = status_data(s)
    if as_json:
        base.emit_json(data)
    else:
        _print_status(data)


# -- jobs ---------------------------------------------------------------------------------


def _cursor_text(state: State, job: Job) -> str:
    return f"{state.value}:{times.to_micros(job.touched_at)}:{job.ref}"


def parse_cursor(value: str) -> tuple[State, tuple[datetime, JobRef]]:
    """A cursor :func:`list_page` gave, as it takes it back; ``ValueError`` naming it."""
    try:
        state, micros, ref = value.split(":", 2)
        return State(state), (times.from_micros(int(micros)), JobRef.parse(ref))
    except (ValueError, TypeError, OverflowError, exceptions.ExactOnceError):
        raise ValueError(f"{value!r} is not a cursor this command printed") from None


def _parse_cursor(
    _ctx: click.Context, param: click.Parameter, value: str | None
) -> tuple[State, tuple[datetime, JobRef]] | None:
    if value is None:
        return None
    try:
        return parse_cursor(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param=param) from None


def list_page(
    store: StateStore,
    states: list[State],
    limit: int,
    cursor: tuple[State, tuple[datetime, JobRef]] | None,
    **filters: Any,
) -> tuple[list[Job], str | None]:
    """Up to ``limit`` jobs of ``states`` (in that order, each oldest touched first).

    From ``cursor`` on; returns the page and the cursor of the next one (``None``: the end).
    """
    start, after = 0, None
    if cursor is not None:
        if cursor[0] not in states:
            raise click.BadParameter(
                "the cursor is of a state not asked for", param_hint="--cursor"
            )
        start, after = states.index(cursor[0]), cursor[1]
    found: list[tuple[State, Job]] = []
    for i, state in enumerate(states[start:]):
        want = limit + 1 - len(found)
        page = store.list_jobs(state, want, after=after if i == 0 else None, **filters)
        found.extend((state, job) for job in page)
        if len(found) > limit:
            break
    more, found = len(found) > limit, found[:limit]
    return [job for _, job in found], (_cursor_text(*found[-1]) if more and found else None)


@click.command()
@click.option(
    "--state",
    "states",
    multiple=True,
    type=click.Choice([s.value for s in State], case_sensitive=False),
    help="Only jobs in this state (repeat for several). Default: every state.",
)
@click.option("--task", help="Only jobs of this task name.")
@click.option("--key", "entry", help="Only occurrences of this beat entry (its key).")
@click.option(
    "--older-than",
    metavar="AGE",
    callback=base.age_option,
    help="Only jobs last touched at least this long ago: 90, 15m, 2h, 1d.",
)
@click.option(
    "--limit",
    type=click.IntRange(1, MAX_LIMIT),
    default=50,
    show_default=True,
    help="Jobs per page.",
)
@click.option(
    "--cursor", callback=_parse_cursor, help="Go on from the page that printed this cursor."
)
@base.json_option
@click.pass_context
@base.handles_errors
def jobs(
    ctx: click.Context,
    states: tuple[str, ...],
    task: str | None,
    entry: str | None,
    older_than: float,
    limit: int,
    cursor: tuple[State, tuple[datetime, JobRef]] | None,
    as_json: bool,
) -> None:
    """List jobs by state (in State order), oldest touched first, a page at a time."""
    chosen = [State(s.upper()) for s in states] or list(State)
    wanted = [s for s in State if s in chosen]
    with base.session(ctx) as s:
        now = s.store.now()
        page, more = list_page(
            s.store, wanted, limit, cursor, older_than=older_than, task=task, entry=entry
        )
    if as_json:
        base.emit_json({"jobs": [base.job_json(j, now) for j in page], "next_cursor": more})
        return
    click.echo(
        base.table(
            ["task id", "state", "task", "entry", "age", "attempt", "node", "reason"],
            [
                [
                    j.ref.id,
                    j.state.value,
                    j.task,
                    j.entry,
                    base.duration(base.age_of(j, now)),
                    j.attempt,
                    j.node,
                    j.reason,
                ]
                for j in page
            ],
        )
    )
    if more:
        click.echo(f"\nmore: --cursor {more}")


# -- show ---------------------------------------------------------------------------------


#: Most ids an ambiguous prefix's usage error names.
CANDIDATES = 5


def find_job(store: StateStore, task_id: str) -> list[Job]:
    """The jobs under ``task_id``: submitted, or a beat occurrence (whose id is its key)."""
    found = [store.get(JobRef.submitted(task_id)), store.get(JobRef.occurrence(task_id))]
    return [job for job in found if job is not None]


def matching_ids(store: StateStore, prefix: str) -> list[str]:
    """The ids that start with ``prefix`` (an id in both key spaces once), a few past
    :data:`CANDIDATES` at most: more than one, and ``prefix`` is ambiguous."""
    return list(dict.fromkeys(ref.id for ref in store.find_ids(prefix, 4 * CANDIDATES)))


def resolve(store: StateStore, task_id: str) -> str:
    """The whole id ``task_id`` names: itself, or the one id it is a prefix of.

    An id the store holds is itself (even if it is also the prefix of
    others). Otherwise, the one id that starts with it, in either key space
    (an id in both is one id); when more than one does, a usage error (exit 2)
    names a few of them. When none does, ``task_id`` itself, which the caller
    does not find.
    """
    if find_job(store, task_id):
        return task_id
    ids = matching_ids(store, task_id)
    if len(ids) > 1:
        shown = ", ".join(ids[:CANDIDATES]) + (", …" if len(ids) > CANDIDATES else "")
        raise click.BadParameter(
            f"{task_id!r} is the start of more than one job's id: {shown}; give more of it",
            param_hint="TASK_ID",
        )
    return ids[0] if ids else task_id


@click.command()
@click.argument("task_id", callback=base.validate_task_id)
@base.json_option
@click.pass_context
@base.handles_errors
def show(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """The job TASK_ID (a Celery task id, or an occurrence's idempotency key) and its history.

    TASK_ID may be the start of an id, as long as no other job's id starts with it.
    """
    with base.session(ctx) as s:
        now = s.store.now()
        found = find_job(s.store, resolve(s.store, task_id))
    if not found:
        base.fail(f"no job {task_id!r} in namespace {s.config.namespace!r}")
    if as_json:
        base.emit_json({"jobs": [base.job_json(job, now, history=True) for job in found]})
        return
    for job in found:
        data = base.job_json(job, now, history=True)
        fields = [k for k in data if k not in ("history", "age")]
        click.echo(base.pairs([(k, data[k]) for k in fields]))
        click.echo("  history")
        click.echo(
            base.table(
                ["at", "from", "to", "node", "reason"],
                [[h["at"], h["from"], h["to"], h["node"], h["reason"]] for h in data["history"]],
            )
        )
