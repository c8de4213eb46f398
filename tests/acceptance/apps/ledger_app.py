"""A Celery app configured only from the environment, whose tasks log every body run.

``celery -A tests.acceptance.apps.ledger_app worker`` runs it; the test process
builds the same app with :func:`make_app` to send tasks. Every setting comes
from these variables (the harness sets them, see ``harness.Deployment.env``):

``EXACTONCE_ACC_BROKER_URL``           broker (``redis://…/10`` or ``amqp://…``)
``EXACTONCE_ACC_QUEUE``                ``task_default_queue`` (unique per test)
``EXACTONCE_ACC_REDIS_PREFIX``         Redis ``global_keyprefix`` (unique per test)
``EXACTONCE_ACC_STORE_URL``            ``exactonce_store_url``
``EXACTONCE_ACC_NAMESPACE``            ``exactonce_namespace``
``EXACTONCE_ACC_LEDGER``               path of the SQLite ledger (``ledger.py``)
``EXACTONCE_ACC_ACKS_LATE``            ``1`` for ``task_acks_late``
``EXACTONCE_ACC_VISIBILITY_TIMEOUT``   seconds; Redis ``visibility_timeout``
``EXACTONCE_ACC_EXTRA_CONF``           JSON object of further settings (``exactonce_*``...)

For ``celery beat -S exactonce`` (``harness.BeatProcess`` sets these):

``EXACTONCE_ACC_BEAT_EVERY``           seconds between the slots of every beat entry (``0``:
                                       none; the beat only sweeps delayed jobs)
``EXACTONCE_ACC_BEAT_ENTRIES``         ``N``: entries ``beat-00`` … ``beat-<N-1>``, every
                                       fourth (``beat-03``, ``beat-07``…) of the plain task
                                       ``plain_beat``, the others of the gated
                                       ``gated_beat``; both record the occurrence's entry
                                       and fire time. Unset: the two entries
                                       ``gated-every`` and ``plain-every``.
``EXACTONCE_ACC_BEAT_EXTRA``           comma-separated names of :data:`EXTRA_ENTRIES` sets to add
                                       to the schedule: ``typed`` (arguments kombu's JSON
                                       carries), ``failing`` (``always-failing``, of the
                                       gated ``gated_failing``, which always raises), or
                                       one bad entry (``bad-argument``,
                                       ``long-name``, ``control-name``, ``retry-option``,
                                       ``unknown-field``, ``text-schedule``)
``EXACTONCE_ACC_EVENTS``               file to append every ``celery_exactonce`` log record
                                       to, as a JSON line with its ``action`` and fields
``EXACTONCE_ACC_CLOCK_OFFSET``         seconds added to this process's wall clock
``EXACTONCE_ACC_CLOCK_JUMP``           seconds the wall clock jumps by …
``EXACTONCE_ACC_CLOCK_JUMP_AFTER``     … this many seconds (monotonic) after import
``EXACTONCE_ACC_STORE_WRITE_FAILURES`` fraction of this process's store writes that raise
                                       ``StoreUnavailable``, half before the write, half
                                       after it applied (``store_faults.py``)
``EXACTONCE_ACC_STORE_FAULT_SEED``     seed of which writes fail (default ``0``)
``EXACTONCE_ACC_STORE_FAULT_METHODS``  comma-separated store methods that may fail
                                       (default: ``store_faults.WRITE_METHODS``)
``EXACTONCE_ACC_STORE_OUTAGE_FILE``    while this file exists, every store operation of the
                                       process raises ``StoreUnavailable`` (an outage)
``EXACTONCE_ACC_KILL_AT``              ``after_claim``: SIGKILL this process right after the
                                       delayed-job sweep claimed a batch (before its
                                       ``DISPATCHED`` write); ``after_dispatched_write``:
                                       right after a dispatch chunk's ``DISPATCHED`` write,
                                       before its publishes (``kill_points.py``)
``EXACTONCE_ACC_KILL_REASON``          the dispatch reason whose ``DISPATCHED`` write kills
                                       (default ``sweep``; ``beat``: slot claims)
``EXACTONCE_ACC_SWEEP``                ``off``: this beat's delayed-job sweep claims nothing
                                       (it runs its slots and the reconciler only)
``EXACTONCE_ACC_NO_GATE``              ``1``: the gated tasks' names are plain tasks here (a
                                       worker still on code from before the gate)
``EXACTONCE_ACC_SLIM``                 a slim beat app, which registers no task: ``1``, its
                                       entries as they are; ``declared``, every entry
                                       declares ``gated`` in its ``exactonce`` options

The clock variables give a process a skewed node clock (there is no
libfaketime here): ``time.time`` and ``time.time_ns`` (so log timestamps show
it) and ``Celery.now`` are replaced at import; the monotonic clock is not
touched, as a real clock step would not touch it. Set them on beat processes
only.

On Redis the unacked-message sweep runs every second
(``unacked_restore_interval=1``, ``unacked_restore_throttle=1``): kombu 5.7's
defaults (10 s x every 10th call) would restore an expired message only about
every 100 s, whatever ``visibility_timeout`` says.

The gated tasks exist only when ``celery_exactonce.ExactOnceTask`` does.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

from celery import Celery, Task

from tests.acceptance.apps import ledger
from tests.acceptance.apps.kill_points import install_kill_points
from tests.acceptance.apps.store_faults import install_store_faults

try:
    from celery_exactonce import ExactOnceTask  # type: ignore[attr-defined]
except ImportError:  # the gate is not written yet: only the plain tasks exist
    ExactOnceTask = None

PLAIN_TASKS = ("plain_record", "slow_record", "plain_beat")
GATED_TASKS = (
    "gated_record",
    "gated_slow",
    "gated_retry",
    "gated_autoretry",
    "gated_beat",
    "gated_redispatch",
)

#: Set (``1``): the app registers the gated tasks' names as plain tasks, as a worker
#: still on code from before the gate would (scenario 65).
NO_GATE = "EXACTONCE_ACC_NO_GATE"

#: The ``celery_exactonce`` loggers' level (``DEBUG`` unless set): a run that measures beat at
#: scale sets ``INFO``, as users run it (a debug record per slot another node claimed
#: would be its own workload).
LOG_LEVEL = "EXACTONCE_ACC_LOG_LEVEL"

#: A slim beat app: no task registered (``1``), entries declaring ``gated`` (``declared``).
SLIM = "EXACTONCE_ACC_SLIM"

#: With ``EXACTONCE_ACC_BEAT_ENTRIES``, every entry whose index is 3 modulo this runs the
#: plain task: beat's claim alone (no gate behind it) keeps those to one run per slot.
BEAT_PLAIN_EVERY = 4

#: The line a skewed process writes to stderr at import, and once its clock has jumped.
CLOCK_MARK = "exactonce-acc clock:"

#: The true wall clock, whatever :func:`install_node_clock` does to ``time.time``.
real_time = time.time

#: Redis sweep for expired unacked messages, in seconds (see the module docstring).
REDIS_RESTORE_INTERVAL = 1


def _flag(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def broker_transport_options(env: Mapping[str, str]) -> dict[str, Any]:
    url = env.get("EXACTONCE_ACC_BROKER_URL", "")
    if url.startswith(("amqp://", "pyamqp://", "amqps://")):
        return {"confirm_publish": True}
    if url.startswith(("redis://", "rediss://", "unix://")):
        options: dict[str, Any] = {
            "unacked_restore_interval": REDIS_RESTORE_INTERVAL,
            "unacked_restore_throttle": 1,
        }
        if env.get("EXACTONCE_ACC_VISIBILITY_TIMEOUT"):
            options["visibility_timeout"] = float(env["EXACTONCE_ACC_VISIBILITY_TIMEOUT"])
        if env.get("EXACTONCE_ACC_REDIS_PREFIX"):
            options["global_keyprefix"] = env["EXACTONCE_ACC_REDIS_PREFIX"]
        return options
    return {}


def make_app(env: Mapping[str, str] = os.environ, *, set_as_current: bool = True) -> Celery:
    """The ledger app configured from ``env`` (``os.environ`` in a worker)."""
    app = Celery("ledger_app", set_as_current=set_as_current)
    queue = env.get("EXACTONCE_ACC_QUEUE", "celery")
    app.conf.update(
        broker_url=env.get("EXACTONCE_ACC_BROKER_URL"),
        broker_transport_options=broker_transport_options(env),
        broker_connection_retry_on_startup=True,
        result_backend=None,
        task_ignore_result=True,
        task_default_queue=queue,
        task_acks_late=_flag(env.get("EXACTONCE_ACC_ACKS_LATE")),
        worker_prefetch_multiplier=1,
        worker_send_task_events=False,
        task_serializer="json",
        accept_content=["json"],
        exactonce_store_url=env.get("EXACTONCE_ACC_STORE_URL"),
        exactonce_namespace=env.get("EXACTONCE_ACC_NAMESPACE", "default"),
    )
    if float(env.get("EXACTONCE_ACC_BEAT_EVERY") or 0) > 0:  # 0: a beat with no entries
        app.conf.beat_schedule = beat_schedule(
            float(env["EXACTONCE_ACC_BEAT_EVERY"]), int(env.get("EXACTONCE_ACC_BEAT_ENTRIES") or 0)
        )
        for name in filter(None, (env.get("EXACTONCE_ACC_BEAT_EXTRA") or "").split(",")):
            app.conf.beat_schedule.update(
                extra_entries(name, float(env["EXACTONCE_ACC_BEAT_EVERY"]))
            )
    slim = env.get(SLIM, "")
    if slim == "declared":
        for entry in (app.conf.beat_schedule or {}).values():
            exactonce = {"gated": entry["task"] in GATED_TASKS}
            entry["options"] = {**entry.get("options", {}), "exactonce": exactonce}
    if env.get("EXACTONCE_ACC_EXTRA_CONF"):
        app.conf.update(json.loads(env["EXACTONCE_ACC_EXTRA_CONF"]))
    # The gate logs suppressed duplicates at debug: let the worker log show them.
    logging.getLogger("celery_exactonce").setLevel(env.get(LOG_LEVEL) or logging.DEBUG)
    ledger_path = env.get("EXACTONCE_ACC_LEDGER", "")
    if not slim:
        _register_tasks(app, ledger_path, gated=not _flag(env.get(NO_GATE)))
    return app


#: Arguments plain JSON cannot hold and kombu's JSON serializer carries (with a type marker).
TYPED_ARGS = (
    datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc),
    datetime(2026, 1, 2, 3, 4, 5),  # naive
    Decimal("19.990"),
    uuid.UUID(int=42),
    b"\x00\xffraw",
)

#: The entry every bad set of :data:`EXTRA_ENTRIES` holds, by set.
BAD_ENTRY_NAMES = {
    "bad-argument": "bad-argument",
    "long-name": "n" * 300,
    "control-name": "bad\tname",
    "retry-option": "retry-option",
    "unknown-field": "unknown-field",
    "text-schedule": "text-schedule",
}


def extra_entries(name: str, every: float) -> dict[str, dict[str, Any]]:
    """The entries of the set ``name`` (``EXACTONCE_ACC_BEAT_EXTRA``)."""
    if name == "typed":
        return {
            f"typed-{kind}": {
                "task": f"{kind}_record",
                "schedule": every,
                "args": (f"typed-{kind}", *TYPED_ARGS),
                "kwargs": {"when": TYPED_ARGS[0], "amount": TYPED_ARGS[2]},
            }
            for kind in ("gated", "plain")
        }
    if name == "failing":
        return {"always-failing": {"task": "gated_failing", "schedule": every, "args": (name,)}}
    entry: dict[str, Any] = {"task": "plain_record", "schedule": every, "args": (name,)}
    if name == "bad-argument":
        entry["args"] = ({"a", "set"},)  # neither JSON nor kombu's JSON holds a set
    elif name == "retry-option":
        entry["options"] = {"retry": True}  # a send_task keyword the dispatch sets itself
    elif name == "unknown-field":
        entry["kwarg"] = {"k": 1}  # no field of Celery's entries: a TypeError in Celery
    elif name == "text-schedule":
        entry["schedule"] = "*/5 * * * *"  # a crontab written as text: Celery keeps the str
    elif name not in BAD_ENTRY_NAMES:
        raise ValueError(f"unknown EXACTONCE_ACC_BEAT_EXTRA set {name!r}")
    return {BAD_ENTRY_NAMES[name]: entry}


def beat_schedule(every: float, entries: int = 0) -> dict[str, dict[str, Any]]:
    """``entries`` entries every ``every`` seconds (module docstring); 0: the two old ones."""
    if not entries:
        return {
            "gated-every": {"task": "gated_record", "schedule": every, "args": ("beat",)},
            "plain-every": {"task": "plain_record", "schedule": every, "args": ("beat",)},
        }
    schedule = {}
    for index in range(entries):
        name = f"beat-{index:02d}"
        plain = index % BEAT_PLAIN_EVERY == BEAT_PLAIN_EVERY - 1
        task = "plain_beat" if plain else "gated_beat"
        schedule[name] = {"task": task, "schedule": every, "args": (name,)}
    return schedule


def _header(task: Task, name: str) -> Any:
    """A message header: Celery puts custom headers on the request, or under ``headers``."""
    value = getattr(task.request, name, None)
    if value is None:
        value = (getattr(task.request, "headers", None) or {}).get(name)
    return value


def _record(
    task: Task, ledger_path: str, phase: str, args: Any, kwargs: Any = None, meta: Any = None
) -> None:
    if not ledger_path:
        raise RuntimeError("EXACTONCE_ACC_LEDGER is not set: nowhere to record the run")
    ledger.append(
        ledger_path,
        task=task.name,
        task_id=task.request.id,
        attempt=task.request.retries or 0,
        phase=phase,
        args=args,
        kwargs=kwargs,
        meta=meta,
    )


def _record_occurrence(task: Task, ledger_path: str, args: Any) -> None:
    """One ``run`` row whose meta names the occurrence: the headers beat's dispatch set."""
    meta = {
        "entry": _header(task, "exactonce_key"),
        "fire_time": _header(task, "exactonce_fire_time"),
        # django-celery-beat's rows (stock beat's too) name themselves in a header.
        "row": _header(task, "periodic_task_name"),
        # The gate sets request.idempotency_key; a plain task only has the header.
        "idempotency_key": getattr(task.request, "idempotency_key", None)
        or _header(task, "idempotency_key"),
    }
    _record(task, ledger_path, "run", args, meta=meta)


def _register_tasks(app: Celery, ledger_path: str, *, gated: bool = True) -> None:
    """The tasks; with ``gated=False``, the gated ones as plain tasks (a worker on old code)."""

    @app.task(bind=True, shared=False, name="plain_record")
    def plain_record(self: Task, *args: Any, **kwargs: Any) -> None:
        _record(self, ledger_path, "run", args, kwargs)

    @app.task(bind=True, shared=False, name="plain_beat")
    def plain_beat(self: Task, *args: Any) -> None:
        _record_occurrence(self, ledger_path, args)

    @app.task(bind=True, shared=False, name="slow_record")
    def slow_record(self: Task, seconds: float) -> None:
        _record(self, ledger_path, "start", [seconds])
        time.sleep(seconds)  # the window in which a redelivery or a kill happens
        _record(self, ledger_path, "end", [seconds])

    if ExactOnceTask is None:
        return
    gate: type[Task] = ExactOnceTask if gated else Task

    @app.task(bind=True, shared=False, base=gate, name="gated_record")
    def gated_record(self: Task, *args: Any, **kwargs: Any) -> None:
        _record(self, ledger_path, "run", args, kwargs)

    @app.task(bind=True, shared=False, base=gate, name="gated_beat")
    def gated_beat(self: Task, *args: Any) -> None:
        _record_occurrence(self, ledger_path, args)

    @app.task(bind=True, shared=False, base=gate, name="gated_slow")
    def gated_slow(self: Task, seconds: float) -> None:
        _record(self, ledger_path, "start", [seconds])
        time.sleep(seconds)
        _record(self, ledger_path, "end", [seconds])

    @app.task(
        bind=True,
        shared=False,
        base=gate,
        name="gated_redispatch",
        exactonce_redispatch=True,
    )
    def gated_redispatch(self: Task, *args: Any) -> None:
        """``gated_record`` opted in to the reconciler's redispatch of a stale message."""
        _record(self, ledger_path, "run", args)

    @app.task(bind=True, shared=False, base=gate, name="gated_failing")
    def gated_failing(self: Task, *args: Any) -> None:
        """Raises, every time: its job ends ``FAILED``."""
        _record(self, ledger_path, "run", args)
        raise RuntimeError("fails on purpose, every time")

    @app.task(bind=True, shared=False, base=gate, name="gated_retry")
    def gated_retry(self: Task, n_fail: int, countdown: float, stage: int = 0) -> None:
        """Retries ``n_fail`` times; each retry carries ``stage`` = the next attempt."""
        _record(self, ledger_path, "run", [n_fail, countdown], {"stage": stage})
        retries = self.request.retries or 0
        if retries < n_fail:
            raise self.retry(
                args=(n_fail, countdown),
                kwargs={"stage": retries + 1},
                countdown=countdown,
                max_retries=5,
            )

    @app.task(
        bind=True,
        shared=False,
        base=gate,
        name="gated_autoretry",
        autoretry_for=(RuntimeError,),
        retry_kwargs={"max_retries": 5, "countdown": 1},
        retry_backoff=False,
        retry_jitter=False,
    )
    def gated_autoretry(self: Task, n_fail: int = 2) -> None:
        """Raises ``RuntimeError`` on the first ``n_fail`` attempts."""
        _record(self, ledger_path, "run", [n_fail])
        if (self.request.retries or 0) < n_fail:
            raise RuntimeError(f"attempt {self.request.retries} fails on purpose")


# --- what a beat process needs: a node clock of its own, its events in a file ------------


def install_node_clock(env: Mapping[str, str]) -> None:
    """Skew this process's wall clock as ``EXACTONCE_ACC_CLOCK_*`` say (nothing if unset).

    Writes a :data:`CLOCK_MARK` line to stderr at once, and another from the first
    reading of the clock after the jump, so a test can check the skew was real.
    """
    offset = float(env.get("EXACTONCE_ACC_CLOCK_OFFSET") or 0)
    jump = float(env.get("EXACTONCE_ACC_CLOCK_JUMP") or 0)
    jump_after = float(env.get("EXACTONCE_ACC_CLOCK_JUMP_AFTER") or 0)
    if not offset and not jump:
        return
    started = time.monotonic()
    jumped = threading.Event()

    def node_time() -> float:
        shift = offset
        if jump and time.monotonic() - started >= jump_after:
            shift += jump
            if not jumped.is_set():
                jumped.set()
                _clock_mark(f"jumped by {jump:+g} s", real_time(), real_time() + shift)
        return real_time() + shift

    def node_now(self: Celery) -> datetime:
        return datetime.fromtimestamp(node_time(), timezone.utc).astimezone(self.timezone)

    time.time = node_time
    time.time_ns = lambda: int(node_time() * 1e9)
    Celery.now = node_now
    _clock_mark(f"offset {offset:+g} s", real_time(), time.time())


def _clock_mark(what: str, real: float, node: float) -> None:
    sys.stderr.write(f"{CLOCK_MARK} {what}: real={real:.6f} node={node:.6f}\n")
    sys.stderr.flush()


#: The attribute a record carries the true wall clock in, taken when it was made.
REAL_FIELD = "exactonce_acc_real"


class EventFile(logging.Handler):
    """Appends each record as a JSON line: its ``action``, message and ``extra`` fields.

    ``created`` is the record's time as logging took it (this process's
    ``time.time()``, skewed or not), ``real`` the true wall clock at the same
    moment (stamped when the record was made, not when it is written: a loaded
    machine may take a while in between).
    """

    _STANDARD = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", REAL_FIELD}

    def __init__(self, path: str) -> None:
        super().__init__(logging.DEBUG)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields = {k: v for k, v in vars(record).items() if k not in self._STANDARD}
            line = {
                "pid": os.getpid(),
                "level": record.levelname,
                "message": record.getMessage(),
                "created": record.created,
                "real": getattr(record, REAL_FIELD, None) or real_time(),
                **fields,
            }
            with open(self.path, "a", encoding="utf-8") as out:
                out.write(json.dumps(line, default=str) + "\n")
        except Exception:  # pragma: no cover - logging must not raise
            self.handleError(record)


def install_event_file(env: Mapping[str, str]) -> None:
    if env.get("EXACTONCE_ACC_EVENTS"):
        make_record = logging.getLogRecordFactory()

        def stamped(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = make_record(*args, **kwargs)
            setattr(record, REAL_FIELD, real_time())  # next to ``created``, read just before
            return record

        logging.setLogRecordFactory(stamped)
        logging.getLogger("celery_exactonce").addHandler(EventFile(env["EXACTONCE_ACC_EVENTS"]))


install_node_clock(os.environ)
install_event_file(os.environ)
install_kill_points(os.environ)
install_store_faults(os.environ)

#: The app ``celery -A tests.acceptance.apps.ledger_app worker`` runs.
app = make_app(os.environ)
