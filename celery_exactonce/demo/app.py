"""The Celery app of ``python -m celery_exactonce demo``, configured from the environment.

``celery -A celery_exactonce.demo.app beat -S exactonce`` and
``celery -A celery_exactonce.demo.app worker`` run it; :mod:`celery_exactonce.demo.run`
starts them and sets:

``EXACTONCE_DEMO_WORKDIR``   the demo's folder: SQLite store, broker folders, ledger
``EXACTONCE_DEMO_NODE``      this process's node id in job histories (``beat-a``...)

No server is involved: the store is ``sqlite:///<workdir>/store.db`` and the
broker is kombu's SQLAlchemy transport on another SQLite file,
``sqla+sqlite:///<workdir>/broker.db``. A message is one row, inserted and
committed in one transaction, so a reader sees it whole or not at all (kombu's
``filesystem://`` transport, the demo's first broker, creates the message file
before it writes it, and a reader could take it empty). The file runs in WAL
mode, every connection waits up to :data:`BROKER_BUSY_TIMEOUT` s for SQLite's
write lock, and :meth:`Layout.prepare` creates the tables and the queue before
any process starts, so the processes never race to create them.

Every beat entry runs :func:`record`, an
:class:`~celery_exactonce.task.base.ExactOnceTask` whose body appends one JSON line
(entry, fire time, idempotency key) to the ledger: the demo's report counts
executions from it, not from logs.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from celery import Celery
from kombu.connection import Connection

from celery_exactonce.dispatch import messages
from celery_exactonce.task.base import ExactOnceTask

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

#: How long a connection to the broker's SQLite file waits for the write lock
#: (sqlite3's ``timeout``; its default, 5 s, is short on a loaded machine).
BROKER_BUSY_TIMEOUT = 30.0
#: kombu's SQLAlchemy transport passes its options on to ``create_engine`` (so
#: it takes no ``polling_interval``: the worker looks at an empty queue once a second).
BROKER_OPTIONS: dict[str, Any] = {"connect_args": {"timeout": BROKER_BUSY_TIMEOUT}}

#: kombu's SQLAlchemy models (``Queue.messages``) use the ``noload`` loader
#: strategy, which SQLAlchemy 2.1 deprecates; the transport never loads that
#: relationship. The warning would land in every demo log: it is silenced here,
#: in the processes that import this module, for that message only.
NOLOAD_WARNING = r"The ``noload`` loader strategy is deprecated"
warnings.filterwarnings("ignore", message=NOLOAD_WARNING, category=DeprecationWarning)


@dataclass(frozen=True)
class Layout:
    """Where the demo keeps everything, under one work folder."""

    workdir: Path

    @property
    def store_url(self) -> str:
        return f"sqlite:///{self.workdir / 'store.db'}"

    @property
    def broker_db(self) -> Path:
        """The SQLite file of the broker (kombu's SQLAlchemy transport)."""
        return self.workdir / "broker.db"

    @property
    def broker_url(self) -> str:
        return f"sqla+sqlite:///{self.broker_db}"

    @property
    def ledger(self) -> Path:
        """One JSON line per task body run (:func:`append_ledger`)."""
        return self.workdir / "ledger.jsonl"

    @contextlib.contextmanager
    def broker(self) -> Iterator[Any]:
        """A channel of the demo's broker, closed (session and connection) on leaving."""
        # kombu's Connection is not annotated: Any from here on.
        conn: Any = Connection(self.broker_url, transport_options=BROKER_OPTIONS)  # type: ignore[no-untyped-call]
        with conn:
            channel = conn.channel()
            try:
                yield channel
            finally:
                # kombu's SQLAlchemy channel does not close its session, which
                # keeps a pooled connection checked out until garbage collection.
                channel.session.close()
                channel.close()

    def prepare(self) -> None:
        """Create the work folder and the broker: WAL mode, kombu's tables, the queue.

        WAL mode is a property of the file, so every later connection uses it:
        readers never wait for a writer, and a publish waits only for another
        write. Idempotent.
        """
        self.workdir.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.broker_db, timeout=BROKER_BUSY_TIMEOUT)
        try:
            db.execute("PRAGMA journal_mode = WAL")
        finally:
            db.close()
        with self.broker() as channel:
            channel.queue_declare(queue=QUEUE)

    def waiting_messages(self) -> int:
        """Messages in the queue, not yet taken by the worker."""
        with self.broker() as channel:
            count: int = channel.queue_declare(queue=QUEUE, passive=True).message_count
        return count


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
    """The demo app: SQLite store, SQLite broker, the beat entries of :data:`ENTRIES`."""
    app = Celery("celery_exactonce.demo.app", set_as_current=False)
    app.conf.update(
        broker_url=layout.broker_url,
        broker_transport_options=BROKER_OPTIONS,
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
        fire_time = getattr(request, messages.HEADER_FIRE_TIME, None) or headers.get(
            messages.HEADER_FIRE_TIME
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
            f"{ENV_WORKDIR} is not set: celery_exactonce.demo.app is run by "
            "`python -m celery_exactonce demo`, which sets it"
        )
    return make_app(Layout(Path(workdir)), env.get(ENV_NODE) or None)


_app: Celery | None = None


def __getattr__(name: str) -> Any:
    """``app``, built on first access: ``celery -A celery_exactonce.demo.app`` looks it up.

    Importing the module for :class:`Layout` or :func:`make_app` needs no environment.
    """
    global _app  # noqa: PLW0603  (one app per process, built lazily)
    if name == "app":
        if _app is None:
            _app = app_from_env()
        return _app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
