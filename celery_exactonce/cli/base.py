"""What every ``celery exactonce`` command shares: the app, the store, input, output, exit codes.

Exit codes (documented in ``docs/howto/cli.md``):

* :data:`EXIT_OK` (0): the command did its work (``check``: no check failed);
* :data:`EXIT_FAILED` (1): a check failed, or the command could not do its work
  (a setting refused, the store unreachable, no such job, a job not cancelled);
  one line on stderr says why, naming the setting when a setting is at fault;
* :data:`EXIT_USAGE` (2): bad input (an unknown option or state, a malformed
  task id, age or cursor, a task id prefix that more than one job's id
  starts with): click's usage error, naming the culprit.

Output is a table (or ``key: value`` lines) for people, or one JSON document
with ``--json`` for scripts: times as ISO-8601 UTC strings, ages in seconds,
states and other enums as their values, never a Python repr. Ids are never
cut, in a table or a ``key: value`` line: what ``jobs`` prints, ``show`` and
``cancel`` take.
No credential is printed: store URLs go through
:func:`~celery_exactonce.stores.redact_url`, and store errors are redacted by
the stores themselves.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import date, datetime, timedelta, timezone
from typing import Any, NoReturn, TypeVar

import click

from celery_exactonce import runtime
from celery_exactonce.config import ExactOnceConfig
from celery_exactonce.core import exceptions, refs
from celery_exactonce.core.jobs import Job
from celery_exactonce.stores import open_store, redact_url, signing
from celery_exactonce.stores.base import StateStore

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

#: Widest cell of a table; longer values are cut with an ellipsis (``--json`` has them whole).
CELL_WIDTH = 60
#: The columns (and ``key: value`` keys) never cut: ids, which ``show`` and ``cancel`` take.
WHOLE = frozenset({"task id", "task_id", "ref", "last task id", "last_task_id"})

_F = TypeVar("_F", bound=Callable[..., Any])

json_option = click.option(
    "--json", "as_json", is_flag=True, help="One JSON document on stdout, for scripts."
)


def wants_json(ctx: click.Context, as_json: bool) -> bool:
    """``--json`` given to this command or to a group it is under (``schedule --json add``)."""
    parent = ctx.parent
    while not as_json and parent is not None:
        as_json = bool(parent.params.get("as_json"))
        parent = parent.parent
    return as_json


class Failed(Exception):
    """The command could not do its work: ``message`` on stderr, exit :data:`EXIT_FAILED`."""


def fail(message: str) -> NoReturn:
    raise Failed(message)


def handles_errors(command: _F) -> _F:
    """Turn :class:`Failed` and the package's errors into one line on stderr and exit 1."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except Failed as exc:
            message = str(exc)
        except exceptions.ConfigurationError as exc:
            message = setting_message(exc)
        except exceptions.StoreError as exc:
            message = f"the store of exactonce_store_url cannot be read or written: {one_line(exc)}"
        except exceptions.ExactOnceError as exc:
            message = one_line(exc)
        click.echo(f"celery-exactonce: error: {message}", err=True)
        raise SystemExit(EXIT_FAILED)

    return wrapper  # type: ignore[return-value]


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def setting_message(error: exceptions.ConfigurationError) -> str:
    """The error's text, ending with the setting it names when the text does not."""
    text = one_line(error)
    if error.setting and error.setting not in text:
        text = f"{text} (setting {error.setting})"
    return text


# -- the app and its store --------------------------------------------------------------


def app_of(ctx: click.Context) -> Any:
    """The Celery app ``celery -A APP`` loaded (Celery's ``CLIContext``), its modules imported."""
    obj = ctx.find_root().obj
    app = getattr(obj, "app", None)
    if app is None:  # not under `celery`: the current app
        from celery import current_app

        app = current_app._get_current_object()
    app.loader.import_default_modules()  # the tasks, as a worker imports them
    return app


@dataclasses.dataclass
class Session:
    """What a command works on: the app, its validated settings and its store (not set up)."""

    app: Any
    config: ExactOnceConfig
    store: StateStore


@contextmanager
def session(ctx: click.Context, *, set_up: bool = True) -> Iterator[Session]:
    """The app's settings and store, the store closed at the end.

    The store is opened as a worker's pool child opens it: no set-up, no
    schema created (``migrate`` does that); with ``set_up``, a store never
    set up is a failure that says to run ``migrate``. Raises
    ``ConfigurationError`` for a refused setting, ``StoreError`` when the store
    cannot be reached.
    """
    app = app_of(ctx)
    config = runtime.config_for(app)
    # Signed where the app signs: stored entries read verified, as beat reads them.
    store = signing.signed(open_store(config, setup=False), config.signing_key)
    try:
        if set_up and store.schema_version() is None:
            fail(
                f"the store {redact_url(config.store_url)} was never set up: a worker or beat "
                "sets it up at start, or run `celery -A APP exactonce migrate`"
            )
        yield Session(app, config, store)
    finally:
        store.close()


# -- input --------------------------------------------------------------------------------

_AGE_PART = re.compile(r"(\d+(?:\.\d+)?)([smhdw]?)")
_AGE_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}


def parse_age(value: str) -> float:
    """A duration in seconds: ``90``, ``90s``, ``15m``, ``2h``, ``1d``, ``1w``, ``1h30m``.

    Raises ``ValueError`` naming the value.
    """
    text = value.strip().lower()
    parts = _AGE_PART.findall(text)
    if not text or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"{value!r} is not an age (e.g. 90, 90s, 15m, 2h, 1d, 1h30m)")
    return float(sum(float(n) * _AGE_UNITS[u] for n, u in parts))


def age_option(_ctx: click.Context, param: click.Parameter, value: str | None) -> float:
    """An ``--older-than`` style option as seconds, or a usage error naming it."""
    try:
        return 0.0 if value is None else parse_age(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param=param) from None


def task_id_argument(value: str) -> str:
    """A job id as the stores accept it, or a usage error naming it."""
    try:
        refs.validate_identifier(value, "task id", refs.MAX_ID_LENGTH)
    except exceptions.InvalidPayload as exc:
        raise click.BadParameter(str(exc), param_hint="TASK_ID") from None
    return value


def validate_task_id(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    return task_id_argument(value)


# -- output -------------------------------------------------------------------------------


def iso(value: datetime | None) -> str | None:
    """An instant as ISO-8601 UTC (``None`` stays ``None``)."""
    return None if value is None else value.astimezone(timezone.utc).isoformat()


def short_time(value: datetime | None) -> str:
    """An instant for a table: ``2026-05-01 03:00:00Z`` (microseconds dropped)."""
    if value is None:
        return "-"
    return value.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def duration(seconds: float | None) -> str:
    """Seconds for people: ``45s``, ``12m03s``, ``3h20m``, ``2d04h``."""
    if seconds is None:
        return "-"
    sign, whole = ("-" if seconds < 0 else ""), int(abs(seconds))
    if whole < 60:
        return f"{sign}{abs(seconds):.0f}s" if whole >= 1 else f"{sign}{abs(seconds):.1f}s"
    minutes, secs = divmod(whole, 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{sign}{days}d{hours:02d}h"
    if hours:
        return f"{sign}{hours}h{minutes:02d}m"
    return f"{sign}{minutes}m{secs:02d}s"


def age_of(job: Job, now: datetime) -> float:
    """Seconds since the job was last touched (a transition or a heartbeat), on store time."""
    return (now - job.touched_at).total_seconds()


def job_json(job: Job, now: datetime | None = None, *, history: bool = False) -> dict[str, Any]:
    """A job for ``--json``: every field, times as ISO-8601 UTC."""
    data: dict[str, Any] = {
        "task_id": job.ref.id,
        "ref": str(job.ref),
        "task": job.task,
        "state": job.state.value,
        "entry": job.entry,
        "fire_time": iso(job.fire_time),
        "run_at": iso(job.run_at),
        "deadline": iso(job.deadline),
        "created_at": iso(job.created_at),
        "touched_at": iso(job.touched_at),
        "heartbeat_at": iso(job.heartbeat_at),
        "terminal_at": iso(job.terminal_at),
        "attempt": job.attempt,
        "dispatches": job.dispatches,
        "run_id": job.run_id,
        "rev": job.rev,
        "node": job.node,
        "reason": job.reason,
        "signed": job.signature is not None,
    }
    if now is not None:
        data["age"] = round(age_of(job, now), 3)
    if history:
        data["args"], data["kwargs"], data["options"] = job.args, job.kwargs, job.options
        data["history"] = [
            {
                "from": entry.src.value if entry.src else None,
                "to": entry.dst.value,
                "at": iso(entry.at),
                "node": entry.node,
                "reason": entry.reason,
                "rev": entry.rev,
                "action": entry.action.value if entry.action else None,
            }
            for entry in job.history
        ]
    return data


_REPR = re.compile(r"<([^<>]*)>")


def plain(value: object) -> Any:
    """A value JSON has no type for, as data: never its Python repr.

    Instants as ISO-8601 UTC, durations in seconds, enums as their values,
    sets as sorted lists; anything else as its text, with the ``<…>`` of a
    repr taken off (``<crontab: 0 3 * * *>`` gives ``crontab: 0 3 * * *``).
    """
    if isinstance(value, datetime):
        return iso(value)
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, set | frozenset):
        return sorted(str(v) for v in value)
    return unwrapped(str(value))


def unwrapped(text: str) -> str:
    """``text`` without the ``<…>`` of the reprs it holds, nested ones too."""
    while (bare := _REPR.sub(r"\1", text)) != text:
        text = bare
    return text


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, ensure_ascii=False, default=plain))


def cell(value: object, *, whole: bool = False) -> str:
    text = "-" if value is None else " ".join(str(value).split())
    return text if whole or len(text) <= CELL_WIDTH else text[: CELL_WIDTH - 1] + "…"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Rows under headers, columns aligned; ``(none)`` for no rows."""
    if not rows:
        return "  (none)"
    keep = [h in WHOLE for h in headers]
    cells = [[cell(v, whole=k) for v, k in zip(row, keep, strict=True)] for row in rows]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(headers)]
    lines = [list(headers), *cells]
    return "\n".join(
        "  " + "  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def pairs(items: Sequence[tuple[str, object]]) -> str:
    """``key: value`` lines, keys aligned."""
    width = max((len(k) for k, _ in items), default=0)
    return "\n".join(f"  {k.ljust(width)}  {cell(v, whole=k in WHOLE)}" for k, v in items)
