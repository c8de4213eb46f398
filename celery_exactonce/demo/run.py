"""``python -m celery_exactonce demo``: the whole thing on one machine, with no servers.

It runs :mod:`celery_exactonce.demo.app` (SQLite store, SQLite broker, four
beat entries every 1, 2, 3 and 5 s, each a gated task that writes one ledger
line per body run) as real processes, each in its own session with its log in
the work folder:

1. the store is set up (schema, epoch) and one worker starts (``-P solo``);
2. two beat nodes start, ``beat-a`` and ``beat-b``, with no leader;
3. once the first slot is claimed the run lasts ``seconds``; half-way through
   ``beat-a`` is SIGKILLed, whatever it is doing, and ``beat-b`` carries on;
4. ``beat-b`` gets SIGTERM, the worker drains the queue and gets SIGTERM
   (every wait is a poll with a deadline; a process that ignores SIGTERM is
   SIGKILLed);
5. the report is built from the store (occurrence records) and the ledger
   (body runs), never from logs.

**The window.** ``due`` counts the nominal slots in ``(start, end]``, where
``start`` is the store time at which the first claim was seen (and at least
the store's birth plus ``max_skew``: a brand-new store refuses older slots)
and ``end`` is the store time of the stop minus ``tick_interval + max_skew``,
so a slot still being claimed when beat stops is not counted as missed.
Slots outside the window that ran are reported as ``outside_window``.
Duplicates are counted over every body run, inside the window or not.

Exit status: 0, 1 when any occurrence ran twice, 2 when the demo could not run.

Not here: starting, watching and stopping one process
(:mod:`~celery_exactonce.demo.processes`), the app the processes run
(:mod:`~celery_exactonce.demo.app`), the report's arithmetic and text
(:mod:`~celery_exactonce.demo.report`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path

from celery_exactonce.beat.entries import occurrence_id
from celery_exactonce.config import ExactOnceConfig
from celery_exactonce.core import keys, refs, slots
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.demo import app as demo_app
from celery_exactonce.demo.processes import POLL_INTERVAL, Child, DemoError, poll
from celery_exactonce.demo.report import DemoResult, Execution, Kill, Slot, build_report
from celery_exactonce.stores import open_store
from celery_exactonce.stores.base import StateStore

UTC = timezone.utc

BEATS = ("beat-a", "beat-b")
#: The beat node SIGKILLed half-way through.
VICTIM = "beat-a"
WORKER = "worker"

#: A slot this close to the stop may still be in flight: not counted as due.
GRACE = demo_app.TICK_INTERVAL + demo_app.MAX_SKEW
#: Shortest run that leaves a window on both sides of the kill.
MIN_SECONDS = 6.0
READY_TIMEOUT = 60.0
DRAIN_TIMEOUT = 30.0


class Demo:
    """One run of the demo in the work folder of ``layout`` (see the module docs)."""

    def __init__(
        self, layout: demo_app.Layout, seconds: float, progress: Callable[[str], None]
    ) -> None:
        self.layout = layout
        self.seconds = seconds
        self.progress = progress
        self.children: dict[str, Child] = {}
        app = demo_app.make_app(layout, node="demo")
        self.config = ExactOnceConfig.from_app(app)
        self.store: StateStore = open_store(self.config)
        born = refs.epoch_born(self.store.epoch())
        self.born = born if born is not None else self.store.now()

    def run(self) -> DemoResult:
        try:
            start = self._start()
            killed = self._run_until_stop(start)
            end = self.store.now() - timedelta(seconds=GRACE)
            drained = self._stop()
            return self._result(start, end, killed, drained)
        finally:
            for child in self.children.values():
                child.kill()
            self.store.close()

    def _start(self) -> datetime:
        """Start the worker and both beats; the window's start (store time)."""
        worker = self.children[WORKER] = Child(
            WORKER,
            [
                "worker",
                "-P",
                "solo",
                "-c",
                "1",
                "-Q",
                demo_app.QUEUE,
                "-n",
                "demo-worker@%h",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "--loglevel",
                "INFO",
            ],
            self.layout,
        )

        def ready() -> bool:
            worker.check_alive()
            lines = worker.log_tail(200).splitlines()
            return any("demo-worker@" in line and line.endswith(" ready.") for line in lines)

        poll(ready, READY_TIMEOUT, f"the worker to be ready (see {worker.log_path})")
        self.progress(f"worker ready (pid {worker.pid}); starting {' and '.join(BEATS)}")
        for name in BEATS:
            self.children[name] = Child(
                name, ["beat", "-S", "exactonce", "--loglevel", "INFO"], self.layout
            )

        def first_claim() -> bool:
            for child in self.children.values():
                child.check_alive()
            return any(self.store.watermark(entry) is not None for entry in demo_app.ENTRIES)

        poll(first_claim, READY_TIMEOUT, "a beat node to claim a first slot")
        start = max(self.store.now(), self.born + timedelta(seconds=self.config.max_skew))
        self.progress(f"first slot claimed; running {self.seconds:g} s")
        return start

    def _run_until_stop(self, start: datetime) -> Kill:
        """Let the nodes work; SIGKILL the victim half-way through."""
        began = time.monotonic() - (self.store.now() - start).total_seconds()
        victim = self.children[VICTIM]
        killed: Kill | None = None
        while (elapsed := time.monotonic() - began) < self.seconds:
            for child in self.children.values():
                if killed is None or child is not victim:
                    child.check_alive()
            if killed is None and elapsed >= self.seconds / 2:
                victim.kill()
                killed = Kill(VICTIM, victim.pid, round(elapsed, 1))
                survivors = ", ".join(name for name in BEATS if name != VICTIM)
                self.progress(
                    f"+{elapsed:.1f} s: SIGKILL {VICTIM} (pid {victim.pid}); {survivors} carries on"
                )
            time.sleep(POLL_INTERVAL)
        if killed is None:  # pragma: no cover - the loop always passes half-way
            raise DemoError("the run ended before the kill")
        return killed

    def _stop(self) -> bool:
        """Stop the beats, let the worker drain the queue, stop it; whether it drained."""
        self.progress(f"+{self.seconds:g} s: stopping the beats, draining the queue")
        for name in BEATS:
            self.children[name].stop()
        worker = self.children[WORKER]

        def drained() -> bool:
            worker.check_alive()
            if self.layout.waiting_messages():
                return False
            return not any(_in_flight(job) for job in self._records().values())

        try:
            poll(drained, DRAIN_TIMEOUT, "the worker to drain the queue")
        except DemoError as exc:
            self.progress(str(exc))
            return False
        finally:
            worker.stop()
        return True

    def _records(self) -> dict[Slot, Job]:
        """The occurrence records of every slot the beats may have claimed."""
        lookback = self.config.window_lookback + max(demo_app.ENTRIES.values())
        start = self.born - timedelta(seconds=lookback)
        end = self.store.now() + timedelta(seconds=1)
        found: dict[Slot, Job] = {}
        for entry, every in demo_app.ENTRIES.items():
            for fire in slots.slots_between(every, start, end, tz=UTC, entry=entry):
                ref = JobRef.occurrence(occurrence_id(self.store.namespace, entry, fire))
                job = self.store.get(ref)
                if job is not None:
                    found[(entry, fire)] = job
        return found

    def _result(self, start: datetime, end: datetime, killed: Kill, drained: bool) -> DemoResult:
        due = [
            (entry, fire)
            for entry, every in demo_app.ENTRIES.items()
            for fire in slots.slots_between(every, start, end, tz=UTC, entry=entry)
        ]
        records = self._records()
        runs = read_ledger(self.layout.ledger)
        report = build_report(due, records.keys(), runs)
        window = set(due)
        ran = {run.slot for run in runs}
        claims = Counter(_claimer(job) for slot, job in records.items() if slot in window)
        not_run = Counter(
            _claimer(job) for slot, job in records.items() if slot in window and slot not in ran
        )
        namespace = self.store.namespace
        mismatches = sum(
            1
            for run in runs
            if run.idempotency_key != keys.idempotency_key(run.entry, run.fire_time, namespace)
        )
        return DemoResult(
            report=report,
            seconds=self.seconds,
            entries=dict(demo_app.ENTRIES),
            beats=BEATS,
            window_start=start,
            window_end=end,
            grace=GRACE,
            killed=killed,
            claims_by_node=dict(claims),
            not_run_by_node=dict(not_run),
            keys_checked=len(runs),
            key_mismatches=mismatches,
            drained=drained,
            left_in_queue=self.layout.waiting_messages(),
        )


def _claimer(job: Job) -> str:
    """The node that created (claimed) the record."""
    return job.history[0].node if job.history else job.node


def _in_flight(job: Job) -> bool:
    """Live and not left behind by the SIGKILLed node (the worker still has it to run)."""
    return not job.terminal and job.node != VICTIM


def _parse_instant(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)


def read_ledger(path: Path) -> list[Execution]:
    """Every body run the ledger holds, in the order written.

    Raises
    ------
    DemoError
        A line is not a ledger record (the file was written by something else).
    """
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    runs = []
    for number, line in enumerate(lines, 1):
        try:
            data = json.loads(line)
            runs.append(
                Execution(
                    str(data["entry"]),
                    _parse_instant(data["fire_time"]),
                    str(data["idempotency_key"]),
                )
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise DemoError(f"{path}:{number}: not a ledger line ({exc}): {line!r}") from exc
    return runs


def run_demo(
    seconds: float = 30.0,
    workdir: Path | None = None,
    *,
    keep: bool = False,
    progress: Callable[[str], None] = lambda _line: None,
) -> DemoResult:
    """Run the demo for ``seconds``; the work folder is a fresh temporary one by default.

    A temporary work folder is removed at the end unless ``keep``; a ``workdir``
    given here is always kept, and must be empty or absent.

    Raises
    ------
    DemoError
        ``seconds`` is too short, ``workdir`` is not empty, or a process did
        not start or died.
    """
    if importlib.util.find_spec("sqlalchemy") is None:
        raise DemoError(
            "the demo's SQLite store and broker need SQLAlchemy: "
            "pip install 'celery-exactonce[demo]'"
        )
    if not math.isfinite(seconds) or seconds < MIN_SECONDS:
        raise DemoError(f"--seconds must be at least {MIN_SECONDS:g}, got {seconds:g}")
    if workdir is None:
        path = Path(tempfile.mkdtemp(prefix="exactonce-demo-"))
    else:
        path = workdir.resolve()
        if path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise DemoError(f"--workdir {path} must be an empty folder, or not exist yet")
        path.mkdir(parents=True, exist_ok=True)
    kept = keep or workdir is not None
    layout = demo_app.Layout(path)
    layout.prepare()
    progress(f"work folder {path}" + ("" if kept else " (removed at the end; --keep keeps it)"))
    try:
        result = Demo(layout, seconds, progress).run()
    finally:
        if not kept:
            shutil.rmtree(path, ignore_errors=True)
    return dataclasses.replace(result, workdir=path if kept else None)
