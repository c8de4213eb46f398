"""The Celery app of ``python -m celery_exactonce demo``, configured from the environment.

``celery -A celery_exactonce.demo_app beat -S exactonce`` and
``celery -A celery_exactonce.demo_app worker`` run it; :mod:`celery_exactonce.demo`
starts them and sets:

``EXACTONCE_DEMO_WORKDIR``   the demo's folder: SQLite store, broker folders, ledger
``EXACTONCE_DEMO_NODE``      this process's node id in job histories (``beat-a``...)

No server is involved: the store is ``sqlite:///<workdir>/store.db`` and the
broker is kombu's ``filesystem://`` transport (one folder holds the queue, so
producers and consumer read and write the same place).

Every beat entry runs :func:`record`, an
:class:`~celery_exactonce.task.ExactOnceTask` whose body appends one JSON line
(entry, fire time, idempotency key) to the ledger: the demo's report counts
executions from it, not from logs.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from celery import Celery

from celery_exactonce import dispatch
from celery_exactonce.task import ExactOnceTask

ENV_WORKDIR = "EXACTONCE_DEMO_WORKDIR"
ENV_NODE = "EXACTONCE_DEMO_NODE"

#: Namespace of the demo's jobs (part of every idempotency key).
NAMESPACE = "demo"
QUEUE = "demo"
TASK = "demo.record"

#: Beat entries: name -> period in seconds. Periods 1, 2, 3 and 5 s make
#: slots of several entries coincide often, which is when nodes race hardest.
ENTRIES: dict[str, float] = {"every-1s": 1.0, "every-2s": 2.0, "every-3s": 3.0, "every-5s": 5.0}

#: Low so the report is lively: beat looks for due slots twice a second, and a
#: brand-new store refuses only the first second of slots (its start-up guard
#: skips slots older than its birth plus ``max_skew``).
TICK_INTERVAL = 0.5
MAX_SKEW = 1.0
#: Short, so a beat's first tick on the brand-new store logs ten skipped slots
#: of ``every-1s``, not the 300 of the default look-back.
WINDOW_LOOKBACK = 10.0

#: How often the worker looks at the queue folder when it is empty (kombu's default: 1 s).
POLLING_INTERVAL = 0.1


@dataclass(frozen=True)
class Layout:
    """Where the demo keeps everything, under one work folder."""

    workdir: Path

    @property
    def store_url(self) -> str:
        return f"sqlite:///{self.workdir / 'store.db'}"

    @property
    def queue_folder(self) -> Path:
        """Messages waiting in the queue (kombu's ``data_folder_in`` and ``_out``)."""
        return self.workdir / "broker" / "queue"

    @property
    def processed_folder(self) -> Path:
        """Messages the worker took from the queue (kept for inspection)."""
        return self.workdir / "broker" / "processed"

    @property
    def control_folder(self) -> Path:
        """kombu's exchange tables (relative to the current folder unless set)."""
        return self.workdir / "broker" / "control"

    @property
    def ledger(self) -> Path:
        """One JSON line per task body run (:func:`append_ledger`)."""
        return self.workdir / "ledger.jsonl"

    def make_folders(self) -> None:
        for folder in (self.queue_folder, self.processed_folder, self.control_folder):
            folder.mkdir(parents=True, exist_ok=True)

    def waiting_messages(self) -> int:
        """Messages in the queue folder, not yet taken by the worker."""
        try:
            return sum(1 for name in os.listdir(self.queue_folder) if name.endswith(".msg"))
        except FileNotFoundError:
            return 0


def append_ledger(path: Path, line: dict[str, Any]) -> None:
    """Append ``line`` as one JSON line, safe with concurrent writers.

    The file is opened with ``O_APPEND`` and the line goes out in a single
    ``write``: each write lands whole at the end of the file, whichever process
    makes it.
    """
    data = (json.dumps(line, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def make_app(layout: Layout, node: str | None = None) -> Celery:
    """The demo app: SQLite store, filesystem broker, the beat entries of :data:`ENTRIES`."""
    app = Celery("celery_exactonce.demo_app", set_as_current=False)
    queue = str(layout.queue_folder)
    app.conf.update(
        broker_url="filesystem://",
        broker_transport_options={
            "data_folder_in": queue,
            "data_folder_out": queue,
            "store_processed": True,
            "processed_folder": str(layout.processed_folder),
            "control_folder": str(layout.control_folder),
            "polling_interval": POLLING_INTERVAL,
        },
        broker_connection_retry_on_startup=True,
        result_backend=None,
        task_ignore_result=True,
        task_default_queue=QUEUE,
        task_serializer="json",
        accept_content=["json"],
        worker_prefetch_multiplier=1,
        worker_enable_remote_control=False,
        worker_send_task_events=False,
        timezone="UTC",
        beat_scheduler="exactonce",
        beat_schedule={
            name: {"task": TASK, "schedule": every, "args": (name,)}
            for name, every in ENTRIES.items()
        },
        exactonce_store_url=layout.store_url,
        exactonce_namespace=NAMESPACE,
        exactonce_tick_interval=TICK_INTERVAL,
        exactonce_max_skew=MAX_SKEW,
        exactonce_window_lookback=WINDOW_LOOKBACK,
        exactonce_node_id=node,
    )
    ledger = layout.ledger

    @app.task(bind=True, base=ExactOnceTask, name=TASK, shared=False)  # type: ignore[untyped-decorator]
    def record(self: ExactOnceTask, entry: str) -> None:
        """Write down one run of ``entry``'s occurrence: entry, fire time, idempotency key."""
        request = self.request
        headers = request.headers if isinstance(request.headers, dict) else {}
        fire_time = getattr(request, dispatch.HEADER_FIRE_TIME, None) or headers.get(
            dispatch.HEADER_FIRE_TIME
        )
        append_ledger(
            ledger,
            {
                "entry": entry,
                "fire_time": fire_time,
                "idempotency_key": request.idempotency_key,
                "task_id": request.id,
                "pid": os.getpid(),
                "at": time.time(),
            },
        )

    return app


def app_from_env(env: Mapping[str, str] = os.environ) -> Celery:
    """The app of a demo child process, from ``EXACTONCE_DEMO_*`` (see the module docs).

    Raises
    ------
    RuntimeError
        ``EXACTONCE_DEMO_WORKDIR`` is not set: the module was not started by the demo.
    """
    workdir = env.get(ENV_WORKDIR)
    if not workdir:
        raise RuntimeError(
            f"{ENV_WORKDIR} is not set: celery_exactonce.demo_app is run by "
            "`python -m celery_exactonce demo`, which sets it"
        )
    return make_app(Layout(Path(workdir)), env.get(ENV_NODE) or None)


_app: Celery | None = None


def __getattr__(name: str) -> Any:
    """``app``, built on first access: ``celery -A celery_exactonce.demo_app`` looks it up.

    Importing the module for :class:`Layout` or :func:`make_app` needs no environment.
    """
    global _app  # noqa: PLW0603  (one app per process, built lazily)
    if name == "app":
        if _app is None:
            _app = app_from_env()
        return _app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
