"""Real ``celery worker`` processes on real brokers and stores, and what their bodies did.

* :class:`Ledger` reads the SQLite file the tasks of ``apps/ledger_app.py``
  append to, one row per body event, from every worker process.
* :class:`WorkerProcess` is one ``celery worker`` (prefork) in its own process
  group, its output in a log file; it can be stopped, SIGKILLed whole, or have
  the pool child that runs a given body SIGKILLed.
* :class:`BeatProcess` is one ``celery beat -S exactonce`` in its own process
  group, its output in a log file and its ``celery_exactonce`` events in a
  JSON-lines file.
* :class:`Deployment` is one test's broker queue, store namespace and ledger,
  with the in-process app that sends the tasks and the workers and beats it
  started.

Every wait is a poll with a deadline (:func:`poll`, :func:`holds`); nothing
here sleeps to let something happen.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from celery import Celery
from celery.result import AsyncResult

from tests import services
from tests.acceptance.apps import ledger as ledger_db
from tests.support.helpers import poll

__all__ = [
    "APP_MODULE",
    "BROKERS",
    "MATRIX",
    "SKIPPED_MARK",
    "STORES",
    "BeatProcess",
    "Deployment",
    "Ledger",
    "Row",
    "WorkerProcess",
    "gate_available",
    "holds",
    "poll",
]

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parents[2]
APP_MODULE = "tests.acceptance.apps.ledger_app"

BROKERS = ("redis", "amqp")
STORES = ("redis", "postgres", "mysql", "sqlite")
#: Every (broker, store) pair the acceptance tests run on unless a test narrows it.
#: A test that names its stores (``acceptance_matrix(stores=...)``) may pick any of
#: :data:`STORES`, MySQL (MariaDB) and SQLite included.
MATRIX = (("redis", "redis"), ("amqp", "redis"), ("redis", "postgres"), ("amqp", "postgres"))

#: The service (``tests.services``) each broker and store needs (SQLite: none, a file).
SERVICE_OF: dict[str, str | None] = {
    "redis": "redis",
    "amqp": "rabbitmq",
    "postgres": "postgres",
    "mysql": "mysql",
    "sqlite": None,
}

#: Redis databases for brokers (db 9 is the store tests'); never flushed, keys are prefixed.
REDIS_BROKER_DB = int(os.environ.get("EXACTONCE_ACC_REDIS_DB", "10"))

READY_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0


def gate_available() -> bool:
    """Whether ``celery_exactonce.ExactOnceTask`` exists (the gated tasks are defined)."""
    from tests.acceptance.apps import ledger_app

    return ledger_app.ExactOnceTask is not None


def holds(check: Callable[[], object], seconds: float, interval: float = 0.05) -> None:
    """Assert ``check()`` stays truthy for ``seconds`` (for "nothing more happens")."""
    deadline = time.monotonic() + seconds
    while True:
        if not check():
            raise AssertionError(f"condition stopped holding within {seconds} s")
        if time.monotonic() > deadline:
            return
        time.sleep(interval)


# --- the ledger ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    id: int
    task: str
    task_id: str
    attempt: int
    phase: str
    args: list[Any]
    kwargs: dict[str, Any]
    pid: int
    at: float
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def occurrence(self) -> tuple[str, datetime] | None:
        """``(entry, fire_time)`` of a beat occurrence's run (``plain_beat``/``gated_beat``)."""
        entry, fire = self.meta.get("entry"), self.meta.get("fire_time")
        if not entry or not fire:
            return None
        return entry, datetime.fromisoformat(fire.replace("Z", "+00:00"))


class Ledger:
    """Read side of the ledger file the worker bodies append to."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        ledger_db.create(self.path)

    def rows(
        self,
        task: str | None = None,
        task_id: str | None = None,
        phase: str | Iterable[str] | None = None,
    ) -> list[Row]:
        """Rows in the order they were written, optionally filtered."""
        where, params = [], []
        if task is not None:
            where.append("task = ?")
            params.append(task)
        if task_id is not None:
            where.append("task_id = ?")
            params.append(task_id)
        if phase is not None:
            phases = [phase] if isinstance(phase, str) else list(phase)
            where.append(f"phase IN ({', '.join('?' * len(phases))})")
            params.extend(phases)
        sql = "SELECT id, task, task_id, attempt, phase, args, kwargs, pid, at, meta FROM ledger"
        if where:
            sql += " WHERE " + " AND ".join(where)
        conn = ledger_db.connect(self.path)
        try:
            found = conn.execute(sql + " ORDER BY id", params).fetchall()
        except sqlite3.OperationalError as exc:  # pragma: no cover - a broken ledger file
            raise AssertionError(f"cannot read the ledger {self.path}: {exc}") from exc
        finally:
            conn.close()
        return [
            Row(
                r[0],
                r[1],
                r[2],
                r[3],
                r[4],
                json.loads(r[5]),
                json.loads(r[6]),
                r[7],
                r[8],
                json.loads(r[9]),
            )
            for r in found
        ]

    def count(
        self,
        task: str | None = None,
        task_id: str | None = None,
        phase: str | Iterable[str] = ledger_db.EXECUTION_PHASES,
    ) -> int:
        """How many body executions began (rows of phase ``run`` or ``start``) by default."""
        return len(self.rows(task=task, task_id=task_id, phase=phase))

    def executions(self, task: str | None = None) -> dict[tuple[str, int], int]:
        """Body executions per ``(task_id, attempt)``."""
        rows = self.rows(task=task, phase=ledger_db.EXECUTION_PHASES)
        return dict(Counter((row.task_id, row.attempt) for row in rows))

    def occurrences(self) -> Counter[tuple[str, datetime]]:
        """Body executions per beat occurrence ``(entry, fire_time)``, from the run rows' meta."""
        runs = Counter[tuple[str, datetime]]()
        for row in self.rows(phase=ledger_db.EXECUTION_PHASES):
            if (occurrence := row.occurrence) is not None:
                runs[occurrence] += 1
        return runs

    def running(self, task_id: str | None = None) -> list[Row]:
        """``start`` rows with no ``end`` row of the same pid, task id and attempt after them."""
        open_runs: dict[tuple[str, int, int], Row] = {}
        for row in self.rows(task_id=task_id, phase=("start", "end")):
            key = (row.task_id, row.attempt, row.pid)
            if row.phase == "start":
                open_runs[key] = row
            else:
                open_runs.pop(key, None)
        return sorted(open_runs.values(), key=lambda row: row.id)

    def wait_count(self, at_least: int, timeout: float = 30.0, **filters: Any) -> list[Row]:
        """Poll until at least ``at_least`` rows match ``filters`` (as :meth:`rows`)."""
        filters.setdefault("phase", ledger_db.EXECUTION_PHASES)

        def enough() -> list[Row] | None:
            found = self.rows(**filters)
            return found if len(found) >= at_least else None

        try:
            return poll(enough, timeout=timeout, interval=0.05)
        except AssertionError:
            raise AssertionError(
                f"ledger: fewer than {at_least} rows matching {filters} within {timeout} s; "
                f"ledger holds {self.rows()}"
            ) from None


# --- worker processes ---------------------------------------------------------------------

_live: set[CeleryProcess] = set()


@atexit.register
def _kill_leftovers() -> None:
    for process in list(_live):
        process.kill()


_P = TypeVar("_P", bound="CeleryProcess")


class CeleryProcess:
    """A ``celery`` command in its own session (process group), its output in ``log_path``.

    Subclasses give ``argv``; the base starts, watches and reads it.
    """

    env: Mapping[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None
    #: The module ``celery -A`` loads: the ledger app unless a process is given another.
    app_module: str = APP_MODULE
    #: Where it runs: the repository, unless a process is given another folder (an example's).
    cwd: Path = REPO_ROOT

    @property
    def argv(self) -> list[str]:
        raise NotImplementedError

    def celery(self, *args: str) -> list[str]:
        """``python -m celery -A <app_module> <args>``."""
        return [sys.executable, "-m", "celery", "-A", self.app_module, *args]

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self!r} was not started")
        return self.proc.pid

    def start(self: _P) -> _P:
        if self.proc is not None:
            raise RuntimeError(f"{self!r} was already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                env=dict(self.env),
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: kill() reaches its children
            )
        _live.add(self)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def kill(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGKILL its process group and reap it (nothing it held is released)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
            raise AssertionError(f"{self!r} survived SIGKILL for {timeout} s") from None
        _live.discard(self)


class WorkerProcess(CeleryProcess):
    """``celery -A tests.acceptance.apps.ledger_app worker -P prefork`` in its own session.

    ``app_module`` runs another app module's worker (the same ``EXACTONCE_ACC_*`` way).
    """

    def __init__(
        self,
        env: dict[str, str],
        log_path: Path,
        *,
        queue: str,
        concurrency: int = 2,
        name: str | None = None,
        extra_args: Iterable[str] = (),
        app_module: str = APP_MODULE,
    ) -> None:
        self.app_module = app_module
        self.env = env
        self.log_path = Path(log_path)
        self.queue = queue
        self.concurrency = concurrency
        self.name = name or f"acc-{uuid.uuid4().hex[:8]}"
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        pid = self.proc.pid if self.proc else None
        return f"<WorkerProcess {self.name} pid={pid} queue={self.queue}>"

    @property
    def argv(self) -> list[str]:
        return self.celery(
            "worker",
            "-P",
            "prefork",
            "-c",
            str(self.concurrency),
            "--without-heartbeat",
            "--without-mingle",
            "--without-gossip",
            "-n",
            f"{self.name}@%h",
            "-Q",
            self.queue,
            "--loglevel",
            "INFO",
            *self.extra_args,
        )

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> WorkerProcess:
        """Poll the log for Celery's ``<name>@<host> ready.`` line; fail if the worker exits."""
        marker = f"{self.name}@"

        def ready() -> bool:
            if not self.alive():
                raise AssertionError(
                    f"{self!r} exited ({self.proc and self.proc.returncode}) before it was "
                    f"ready; log:\n{self.log_tail()}"
                )
            return any(
                marker in line and line.rstrip().endswith(" ready.")
                for line in self.log().splitlines()
            )

        try:
            poll(ready, timeout=timeout, interval=0.1)
        except AssertionError as exc:
            if "exited" in str(exc):
                raise
            raise AssertionError(
                f"{self!r} not ready within {timeout} s; log:\n{self.log_tail()}"
            ) from None
        return self

    def _wait_exit(self, timeout: float) -> bool:
        assert self.proc is not None
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def terminate(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """Warm shutdown (SIGTERM: running bodies finish); SIGKILL of the group after ``timeout``.

        Returns the main process's exit status.
        """
        if self.proc is None:
            return None
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            if not self._wait_exit(timeout):
                self.kill()
        self._signal_group(signal.SIGKILL)  # pool children that outlived the main process
        _live.discard(self)
        return self.proc.returncode

    def kill(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGKILL the whole process group (main process and pool children), and reap it."""
        if self.proc is None:
            return
        self._signal_group(signal.SIGKILL)
        if not self._wait_exit(timeout):  # pragma: no cover - SIGKILL cannot be ignored
            raise AssertionError(f"{self!r} survived SIGKILL for {timeout} s")
        _live.discard(self)

    def saw_worker_lost(self) -> bool:
        """Whether the main process has logged a ``WorkerLostError`` (a pool child died)."""
        return "WorkerLostError" in self.log()

    def owns(self, pid: int) -> bool:
        """Whether ``pid`` is a live process of this worker's process group."""
        try:
            return os.getpgid(pid) == self.pid
        except ProcessLookupError:
            return False

    def kill_child_in_body(
        self, ledger: Ledger, task_id: str | None = None, timeout: float = 30.0
    ) -> int:
        """SIGKILL the pool child running a body (``task_id``'s, or any) of this worker.

        Waits for a ``start`` row without its ``end`` (a ``slow_record``/``gated_slow``
        body) written by one of this worker's processes; returns the killed pid.
        With Celery's defaults (``task_reject_on_worker_lost`` off) the main
        process then fails the task with ``WorkerLostError`` and acks the message,
        even with ``acks_late``: to get a redelivery, :meth:`kill` the whole worker.
        The main process notices the dead child only at its next pool check (up
        to about 5 s later): wait for :meth:`WorkerProcess.saw_worker_lost`.
        """

        def victim() -> int | None:
            for row in ledger.running(task_id):
                if self.owns(row.pid):
                    return row.pid
            return None

        try:
            pid = poll(victim, timeout=timeout, interval=0.02)
        except AssertionError:
            raise AssertionError(
                f"no body of {task_id or 'any task'} running in {self!r} within {timeout} s; "
                f"ledger holds {ledger.rows()}"
            ) from None
        os.kill(pid, signal.SIGKILL)
        poll(lambda: not _pid_alive(pid), timeout=10)
        return pid

    def kill_children_in_bodies(self, ledger: Ledger, count: int, timeout: float = 60.0) -> None:
        """SIGKILL ``count`` pool children of this worker, each in the middle of a body
        (:meth:`kill_child_in_body`), each a child not killed before (a fresh one)."""
        killed: set[int] = set()
        while len(killed) < count:

            def in_a_live_child() -> str | None:
                rows = [r for r in ledger.running() if r.pid not in killed and self.owns(r.pid)]
                return rows[0].task_id if rows else None

            killed.add(self.kill_child_in_body(ledger, poll(in_a_live_child, timeout=timeout)))


def _pid_alive(pid: int) -> bool:
    """Alive and not a zombie (a killed pool child stays a zombie until its parent reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


# --- beat processes -------------------------------------------------------------------------

#: What ``celery beat`` logs once its scheduler is built (the store is reached by then:
#: ``ExactOnceScheduler`` opens it in its constructor, before the banner).
BEAT_STARTED = "beat: Starting..."


class BeatProcess(CeleryProcess):
    """``celery -A tests.acceptance.apps.ledger_app beat -S exactonce`` in its own session.

    Its output goes to ``<name>.log``, and every ``celery_exactonce`` log record
    (with its ``action`` and fields, ``ledger_app.EventFile``) to
    ``<name>.events.jsonl``, both in ``directory``. ``app_module`` runs another app
    module's beat.
    """

    def __init__(
        self, env: Mapping[str, str], directory: Path, name: str, *, app_module: str = APP_MODULE
    ) -> None:
        self.app_module = app_module
        self.name = name
        self.log_path = Path(directory) / f"{name}.log"
        self.events_path = Path(directory) / f"{name}.events.jsonl"
        self.env = {**env, "EXACTONCE_ACC_EVENTS": str(self.events_path)}
        self.schedule_path = Path(directory) / f"{name}.celerybeat-schedule"  # unused by us
        self.proc: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        pid = self.proc.pid if self.proc else None
        return f"<BeatProcess {self.name} pid={pid}>"

    @property
    def argv(self) -> list[str]:
        return self.celery(
            "beat", "-S", "exactonce", "-s", str(self.schedule_path), "--loglevel", "INFO"
        )

    @property
    def node(self) -> str:
        """The node name its claims carry (``exactonce_node_id`` unset: ``host:pid``)."""
        return f"{socket.gethostname()}:{self.pid}"

    def events(self, action: str | None = None) -> list[dict[str, Any]]:
        """The ``celery_exactonce`` records it logged so far, optionally of one ``action``."""
        try:
            text = self.events_path.read_text(errors="replace")
        except FileNotFoundError:
            return []
        found = []
        for line in text.splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:  # a line being written as we read
                continue
            if action is None or event.get("action") == action:
                found.append(event)
        return found

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> BeatProcess:
        """Poll the log for :data:`BEAT_STARTED`; fail if beat exits first."""

        def ready() -> bool:
            if not self.alive():
                raise AssertionError(
                    f"{self!r} exited ({self.proc and self.proc.returncode}) before it "
                    f"started; log:\n{self.log_tail()}"
                )
            return BEAT_STARTED in self.log()

        try:
            poll(ready, timeout=timeout, interval=0.1)
        except AssertionError as exc:
            if "exited" in str(exc):
                raise
            raise AssertionError(
                f"{self!r} not started within {timeout} s; log:\n{self.log_tail()}"
            ) from None
        return self


# --- one test's deployment ----------------------------------------------------------------


def _redis_broker_url(db: int) -> str:
    parts = urlsplit(services.REDIS_URL)
    return urlunsplit((parts.scheme, parts.netloc, f"/{db}", "", ""))


#: What the gate logs (at debug) for each delivery it skips as a duplicate.
SKIPPED_MARK = "duplicate delivery of"


def in_tree(env: Mapping[str, str], tree: Path) -> dict[str, str]:
    """``env`` with the source tree ``tree`` (another version's) first on ``PYTHONPATH``, in
    place of this repository: a process started with it imports that tree's package."""
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO_ROOT)]
    return {**env, "PYTHONPATH": os.pathsep.join([str(tree), *paths])}


def process_env(**settings: str) -> dict[str, str]:
    """The environment of a test's ``celery`` process: this one's, without any
    ``EXACTONCE_ACC_*`` of it, the repository first on ``PYTHONPATH``, and ``settings``."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("EXACTONCE_ACC_")}
    pythonpath = [str(REPO_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update(PYTHONPATH=os.pathsep.join(pythonpath), PYTHONUNBUFFERED="1", **settings)
    return env


class Deployment:
    """One test's broker queue, store namespace and ledger, and the workers it started.

    Call :meth:`configure` (acks_late, visibility_timeout) before :meth:`app`
    or :meth:`start_worker`: sender and workers must agree. The queue (and on
    Redis a ``global_keyprefix``), the store namespace and the ledger file are
    unique to the deployment; :meth:`close` kills the workers and removes them.
    """

    def __init__(self, broker: str, store: str, tmp_path: Path) -> None:
        if broker not in BROKERS or store not in STORES:
            raise ValueError(f"unknown deployment {broker}/{store}")
        tmp_path = Path(tmp_path)
        self.broker = broker
        self.store_kind = store
        self.tmp_path = Path(tmp_path)
        self.uid = uuid.uuid4().hex[:10]
        self.queue = f"acc-{self.uid}"
        self.namespace = f"acc-{self.uid}"
        self.redis_prefix = f"acc-{self.uid}:" if broker == "redis" else ""
        self.broker_url = (
            _redis_broker_url(REDIS_BROKER_DB) if broker == "redis" else services.AMQP_URL
        )
        #: Every process of the deployment uses this store; a test may point it elsewhere
        #: (a private server) before it starts any.
        self.store_url = (
            f"sqlite:///{tmp_path / 'store.sqlite3'}"  # a file every process shares
            if store == "sqlite"
            else services.SERVICE_URLS[store]
        )
        #: Options of the in-process store (``store_from_url``), as the processes' settings
        #: give theirs (e.g. ``shards`` with ``exactonce_shards`` in EXACTONCE_ACC_EXTRA_CONF).
        self.store_options: dict[str, Any] = {}
        self.ledger_path = self.tmp_path / "ledger.sqlite3"
        self.ledger = Ledger(self.ledger_path)
        self.acks_late = False
        self.visibility_timeout: float | None = None
        self.workers: list[WorkerProcess] = []
        self.beats: list[BeatProcess] = []
        self._closed = False
        #: Extra environment of the workers started from now on (e.g. a store URL
        #: through a fault-injecting proxy, EXACTONCE_ACC_EXTRA_CONF).
        self.extra_env: dict[str, str] = {}
        self._app: Celery | None = None
        self._store: Any = None

    def __repr__(self) -> str:
        return f"<Deployment {self.broker}/{self.store_kind} queue={self.queue}>"

    @property
    def id(self) -> str:
        return f"{self.broker}-{self.store_kind}"

    def configure(
        self, *, acks_late: bool | None = None, visibility_timeout: float | None = None
    ) -> Deployment:
        """Settings shared by sender and workers; only before either exists."""
        if self._app is not None or self.workers:
            raise RuntimeError("configure() the deployment before app() and start_worker()")
        if acks_late is not None:
            self.acks_late = acks_late
        if visibility_timeout is not None:
            self.visibility_timeout = visibility_timeout
        return self

    @property
    def env(self) -> dict[str, str]:
        """The environment of a worker (and of :meth:`app`): ``EXACTONCE_ACC_*``."""
        env = process_env(
            EXACTONCE_ACC_BROKER_URL=self.broker_url,
            EXACTONCE_ACC_QUEUE=self.queue,
            EXACTONCE_ACC_STORE_URL=self.store_url,
            EXACTONCE_ACC_NAMESPACE=self.namespace,
            EXACTONCE_ACC_LEDGER=str(self.ledger_path),
            EXACTONCE_ACC_ACKS_LATE="1" if self.acks_late else "0",
        )
        if self.redis_prefix:
            env["EXACTONCE_ACC_REDIS_PREFIX"] = self.redis_prefix
        if self.visibility_timeout is not None:
            env["EXACTONCE_ACC_VISIBILITY_TIMEOUT"] = str(self.visibility_timeout)
        env.update(self.extra_env)
        return env

    def app(self) -> Celery:
        """The in-process app, configured as the workers are, to send tasks with."""
        if self._app is None:
            from tests.acceptance.apps.ledger_app import make_app

            self._app = make_app(self.env, set_as_current=False)
            self._declare_queue()
        return self._app

    def send(self, task: str, *args: Any, **options: Any) -> AsyncResult:
        """``apply_async`` of the registered ``task`` with ``args`` (``kwargs=`` in options)."""
        return self.app().tasks[task].apply_async(args=args, **options)

    def store(self) -> Any:
        """The deployment's store (``celery_exactonce.store_from_url``), set up once."""
        if self._store is None:
            from celery_exactonce import store_from_url

            store = store_from_url(self.store_url, namespace=self.namespace, **self.store_options)
            store.setup()
            self._store = store
        return self._store

    def job(self, task_id: str) -> Any:
        """The store's record of the (non-occurrence) job ``task_id``, or ``None``."""
        from celery_exactonce.core.refs import JobRef

        return self.store().get(JobRef.submitted(task_id))

    def record(self, task_id: str) -> Any:
        """:meth:`job`, which must exist."""
        job = self.job(task_id)
        assert job is not None, f"no record for {task_id}"
        return job

    def job_state(self, task_id: str) -> Any:
        """The state of :meth:`job`, or ``None`` when there is no record."""
        job = self.job(task_id)
        return None if job is None else job.state

    def skipped_deliveries(self) -> int:
        """Deliveries the gate skipped as duplicates, counted in every worker's log."""
        return sum(worker.log().count(SKIPPED_MARK) for worker in self.workers)

    def start_worker(
        self,
        concurrency: int = 2,
        *,
        wait: bool = True,
        timeout: float = READY_TIMEOUT,
        extra_args: Iterable[str] = (),
        app_module: str = APP_MODULE,
        tree: Path | None = None,
    ) -> WorkerProcess:
        """Start a worker on the deployment's queue; by default wait until it is ready.

        ``tree``: the source tree of another version of the package, which the worker
        runs instead of this one's (:func:`in_tree`).
        """
        if gate_available():
            self.store()  # schema and namespace exist before any gate runs
        self.app()  # the queue exists before the worker consumes
        index = len(self.workers) + 1
        worker = WorkerProcess(
            self.env if tree is None else in_tree(self.env, tree),
            self.tmp_path / f"worker-{index}.log",
            queue=self.queue,
            concurrency=concurrency,
            name=f"acc{index}-{self.uid}",
            extra_args=extra_args,
            app_module=app_module,
        )
        if tree is not None:  # `python -m` puts its folder first on sys.path
            worker.cwd = tree
        self.workers.append(worker)
        worker.start()
        if wait:
            worker.wait_ready(timeout)
        return worker

    def start_beat(
        self,
        *,
        every: float = 1.0,
        entries: int = 0,
        extra_env: Mapping[str, str] | None = None,
        wait: bool = True,
        timeout: float = READY_TIMEOUT,
        tree: Path | None = None,
    ) -> BeatProcess:
        """Start ``celery beat -S exactonce`` with the ledger app's beat schedule.

        ``every`` and ``entries`` are ``EXACTONCE_ACC_BEAT_EVERY`` and
        ``EXACTONCE_ACC_BEAT_ENTRIES`` (see ``apps/ledger_app.py``); ``extra_env``
        is added to this beat's environment only (a skewed clock, say). By
        default waits until beat has started. ``tree``: the source tree of another version
        of the package, which beat runs instead of this one's (:func:`in_tree`).
        """
        if gate_available():
            self.store()  # schema and namespace exist before any beat claims
        self.app()  # the queue exists before anything is published to it
        env = {
            **self.env,
            "EXACTONCE_ACC_BEAT_EVERY": str(every),
            "EXACTONCE_ACC_BEAT_ENTRIES": str(entries),
            **(extra_env or {}),
        }
        env = env if tree is None else in_tree(env, tree)
        beat = BeatProcess(env, self.tmp_path, f"beat-{len(self.beats) + 1}")
        if tree is not None:  # `python -m` puts its folder first on sys.path
            beat.cwd = tree
        self.beats.append(beat)
        beat.start()
        if wait:
            beat.wait_ready(timeout)
        return beat

    def _declare_queue(self) -> None:
        assert self._app is not None
        with self._app.connection_for_write() as conn:
            self._app.amqp.queues[self.queue](conn.default_channel).declare()

    def purge(self) -> int:
        """Drop the messages waiting in the queue; how many were dropped."""
        with self.app().connection_for_write() as conn:
            return int(conn.default_channel.queue_purge(self.queue) or 0)

    def waiting(self) -> int:
        """Messages in the deployment's queue on the broker, not yet delivered to a worker."""
        with self.app().connection_for_write() as conn:
            return int(conn.default_channel.queue_declare(queue=self.queue, passive=True)[1])

    def exactonce(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``celery -A <ledger app> exactonce ARGS`` as an operator runs it, on the
        deployment's settings; it must succeed."""
        env = {**os.environ, **self.env}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        argv = [sys.executable, "-m", "celery", "-A", APP_MODULE, "exactonce", *args]
        done = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 0, (args[:3], done.stdout, done.stderr)
        return done

    def broker_report(self) -> str:
        """Where the deployment's messages are, and the last lines of each worker's log:
        for the message of a test that waited on a delivery."""
        unacked = f", {self.unacked()} delivered unacked" if self.broker == "redis" else ""
        logs = "".join(f"\n--- {w.name} ---\n{w.log_tail(60)}" for w in self.workers)
        return f"broker: {self.waiting()} waiting in {self.queue}{unacked}{logs}"

    def unacked(self) -> int:
        """Messages delivered and not yet acked (Redis only: the transport's ``unacked`` hash).

        RabbitMQ does not tell an AMQP client this (its management API does).
        """
        if self.broker != "redis":
            raise NotImplementedError("unacked() counts Redis deliveries only")
        import redis

        client = redis.Redis.from_url(self.broker_url)
        try:
            return int(client.hlen(f"{self.redis_prefix}unacked"))
        finally:
            client.close()

    def _drop_broker_state(self) -> None:
        if self.broker == "redis":
            services.delete_redis_keys(self.broker_url, f"{self.redis_prefix}*")
        else:
            with self.app().connection_for_write() as conn:
                channel = conn.default_channel
                channel.queue_delete(self.queue)
                channel.exchange_delete(self.queue)

    def logs(self) -> str:
        processes: list[WorkerProcess | BeatProcess] = [*self.workers, *self.beats]
        return "\n".join(f"--- {p.name}\n{p.log_tail(80)}" for p in processes)

    def close(self) -> None:
        """Kill the beats and workers, empty and remove the queue, drop the store namespace.

        Only the first call does anything: a test may close early (while a
        private store server it started is still up), the fixture closes again.
        """
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        processes: list[BeatProcess | WorkerProcess] = [*self.beats, *self.workers]
        for process in processes:
            try:
                process.kill()
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)
        steps: list[Callable[[], object]] = []
        if self._app is not None or self.workers:
            steps.append(self._drop_broker_state)
        if self._store is not None or gate_available():
            steps.append(self._drop_store_namespace)
        for step in steps:
            try:
                step()
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)
        if self._app is not None:
            self._app.close()
            self._app = None
        if errors:
            raise errors[0]

    def _drop_store_namespace(self) -> None:
        store = self._store
        if store is None:
            from celery_exactonce import store_from_url

            store = store_from_url(self.store_url, namespace=self.namespace, **self.store_options)
        try:
            store.drop_namespace()
        finally:
            store.close()
            self._store = None
