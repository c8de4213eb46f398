"""The arithmetic and the text of the demo's report: pure functions, no I/O.

:func:`build_report` takes three sets of facts about occurrences, each one a
slot ``(entry, fire_time)``:

* **due**: the nominal slots of every entry inside the measured window (the
  caller picks the window, see :mod:`celery_exactonce.demo.run`);
* **dispatched**: the slots with an occurrence record in the store (claimed by
  a beat node); only those inside the window are counted;
* **executed**: one :class:`Execution` per task body run, from the ledger.

and counts, for the window: ``due``, ``dispatched``, ``executed`` (body runs),
``missed`` (due, never run) and ``claimed_not_run`` (dispatched, never run).
``duplicates`` (slots whose body ran more than once) is counted over *every*
execution, inside the window or not: no choice of window can hide one.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

Slot = tuple[str, datetime]
"""One occurrence: ``(entry, fire_time)``, the fire time an aware UTC datetime."""

#: How many example idempotency keys a report shows.
EXAMPLES = 3


@dataclasses.dataclass(frozen=True)
class Execution:
    """One run of a task body, as the ledger recorded it."""

    entry: str
    fire_time: datetime
    idempotency_key: str

    @property
    def slot(self) -> Slot:
        return (self.entry, self.fire_time)


@dataclasses.dataclass(frozen=True)
class Report:
    """What happened to the occurrences of the window (see the module docs)."""

    due: int
    """Nominal slots in the window."""
    dispatched: int
    """Slots of the window with an occurrence record (claimed once, by one node)."""
    executed: int
    """Body runs of slots in the window (a duplicate counts each run)."""
    duplicates: int
    """Slots, anywhere in the run, whose body ran more than once. Must be 0."""
    missed: int
    """Slots of the window whose body never ran."""
    claimed_not_run: int
    """Missed slots that were dispatched (a node died between claim and publish)."""
    never_claimed: int
    """Missed slots that no node claimed (``missed == claimed_not_run + never_claimed``)."""
    outside_window: int
    """Body runs of slots outside the window (the edges of the run), not counted above."""
    duplicate_slots: tuple[Slot, ...] = ()
    missed_slots: tuple[Slot, ...] = ()
    examples: tuple[Execution, ...] = ()

    @property
    def exit_status(self) -> int:
        """1 when any occurrence ran twice, else 0."""
        return 1 if self.duplicates else 0


@dataclasses.dataclass(frozen=True)
class Kill:
    """The beat node SIGKILLed half-way through the run."""

    node: str
    pid: int
    after: float
    """Seconds after the window's start."""


@dataclasses.dataclass(frozen=True)
class DemoResult:
    """The report and the facts of one run of the demo."""

    report: Report
    seconds: float
    entries: dict[str, float]
    """Beat entry -> period in seconds."""
    beats: tuple[str, ...]
    window_start: datetime
    window_end: datetime
    grace: float
    """Seconds between the window's end and the stop (slots still in flight)."""
    killed: Kill
    claims_by_node: dict[str, int]
    """Occurrence records of the window, per node that claimed them."""
    not_run_by_node: dict[str, int]
    """Records of the window whose body never ran, per node that claimed them."""
    keys_checked: int
    key_mismatches: int
    """Ledger keys that differ from ``idempotency_key(entry, fire_time, namespace)``."""
    drained: bool
    """Whether the worker emptied the queue before it was stopped."""
    left_in_queue: int
    workdir: Path | None = None
    """The work folder, when it is kept."""

    @property
    def exit_status(self) -> int:
        """1 when any occurrence ran twice, else 0."""
        return self.report.exit_status


def build_report(
    due: Iterable[Slot], dispatched: Iterable[Slot], executed: Iterable[Execution]
) -> Report:
    """Count what happened to the ``due`` slots; see the module docs for the definitions.

    Invariants of the result: ``dispatched <= due``, ``missed == claimed_not_run +
    never_claimed``, and without duplicates ``executed == due - missed ==
    dispatched - claimed_not_run`` (when every run has a record).
    """
    window = set(due)
    runs = list(executed)
    per_slot = Counter(run.slot for run in runs)
    ran = {slot for slot in per_slot if slot in window}
    claimed = {slot for slot in dispatched if slot in window}
    duplicate_slots = sorted(slot for slot, count in per_slot.items() if count > 1)
    missed_slots = sorted(window - ran)
    return Report(
        due=len(window),
        dispatched=len(claimed),
        executed=sum(count for slot, count in per_slot.items() if slot in window),
        duplicates=len(duplicate_slots),
        missed=len(missed_slots),
        claimed_not_run=len(claimed - ran),
        never_claimed=len(window - ran - claimed),
        outside_window=sum(count for slot, count in per_slot.items() if slot not in window),
        duplicate_slots=tuple(duplicate_slots),
        missed_slots=tuple(missed_slots),
        examples=pick_examples([run for run in runs if run.slot in window]),
    )


def pick_examples(runs: Sequence[Execution], count: int = EXAMPLES) -> tuple[Execution, ...]:
    """Up to ``count`` runs, earliest first, one per entry while entries last."""
    ordered = sorted(runs, key=lambda run: (run.fire_time, run.entry))
    chosen: list[Execution] = []
    seen: set[str] = set()
    for run in ordered:
        if run.entry not in seen and len(chosen) < count:
            chosen.append(run)
            seen.add(run.entry)
    for run in ordered:
        if len(chosen) >= count:
            break
        if run not in chosen:
            chosen.append(run)
    return tuple(sorted(chosen, key=lambda run: (run.fire_time, run.entry)))


# -- rendering ------------------------------------------------------------------------


def clock(instant: datetime) -> str:
    """``HH:MM:SS.mmm`` of ``instant``."""
    return instant.strftime("%H:%M:%S.%f")[:-3]


def _slot_json(slot: Slot) -> dict[str, str]:
    return {"entry": slot[0], "fire_time": slot[1].isoformat()}


def report_json(report: Report) -> dict[str, Any]:
    """The report as JSON-able data (the ``report`` part of ``demo --json``)."""
    return {
        "due": report.due,
        "dispatched": report.dispatched,
        "executed": report.executed,
        "duplicates": report.duplicates,
        "missed": report.missed,
        "claimed_not_run": report.claimed_not_run,
        "never_claimed": report.never_claimed,
        "outside_window": report.outside_window,
        "duplicate_slots": [_slot_json(slot) for slot in report.duplicate_slots],
        "missed_slots": [_slot_json(slot) for slot in report.missed_slots],
        "examples": [
            {**_slot_json(run.slot), "idempotency_key": run.idempotency_key}
            for run in report.examples
        ],
        "exit_status": report.exit_status,
    }


def _per_node(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{node} {n}" for node, n in sorted(counts.items()))


def render_counts(
    report: Report,
    claims_by_node: Mapping[str, int],
    not_run_by_node: Mapping[str, int] | None = None,
) -> list[str]:
    """The lines of the report that hold its counts, its examples and its verdict."""
    claims = _per_node(claims_by_node)
    missed = ""
    if report.missed:
        not_run = _per_node(not_run_by_node or {})
        missed = (
            f"  {report.never_claimed} never claimed, {report.claimed_not_run} claimed and "
            "never run" + (f" (claimed by {not_run})" if not_run else "")
        )
    lines = [
        f"  due          {report.due:5d}  nominal slots in the window",
        f"  dispatched   {report.dispatched:5d}  claimed in the store, once each"
        + (f" ({claims})" if claims else ""),
        f"  executed     {report.executed:5d}  task bodies run (ledger)",
        f"  duplicates   {report.duplicates:5d}",
        f"  missed       {report.missed:5d}{missed}",
    ]
    for entry, fire in report.duplicate_slots[:EXAMPLES]:
        lines.append(f"    ran twice: {entry} at {clock(fire)}")
    for entry, fire in report.missed_slots[:EXAMPLES]:
        lines.append(f"    missed: {entry} at {clock(fire)}")
    if report.examples:
        lines.append("  idempotency keys (entry, fire time UTC, key):")
        lines.extend(
            f"    {run.entry:<9} {clock(run.fire_time)}  {run.idempotency_key}"
            for run in report.examples
        )
    if report.duplicates:
        lines.append(f"  FAILED: {report.duplicates} occurrence(s) ran more than once")
    else:
        lines.append("  OK: no occurrence ran twice")
    return lines


def render(result: DemoResult) -> str:
    """The human report of a run: a few lines."""
    start, end = result.window_start, result.window_end
    every = ", ".join(f"{period:g}" for period in result.entries.values())
    survivors = " and ".join(name for name in result.beats if name != result.killed.node)
    lines = [
        f"celery-exactonce demo: {len(result.beats)} beat nodes (no leader), one worker, "
        "SQLite store and broker",
        f"  {len(result.entries)} beat entries (every {every} s) of a gated task",
        f"  {result.killed.node} (pid {result.killed.pid}) SIGKILLed at "
        f"+{result.killed.after:g} s; {survivors} carried on",
        f"  window {clock(start)} -> {clock(end)} UTC ({(end - start).total_seconds():.1f} s): "
        f"from the first claim to the stop - {result.grace:g} s",
        *render_counts(result.report, result.claims_by_node, result.not_run_by_node),
    ]
    if result.key_mismatches:
        lines.insert(-1, f"  {result.key_mismatches} ledger key(s) differ from idempotency_key()")
    if not result.drained or result.left_in_queue:
        lines.insert(-1, f"  the worker did not drain the queue: {result.left_in_queue} left")
    if result.workdir is not None:
        lines.append(f"  logs, store and ledger kept in {result.workdir}")
    return "\n".join(lines)


def result_json(result: DemoResult) -> dict[str, Any]:
    """The run as JSON-able data (``demo --json``)."""
    return {
        "report": report_json(result.report),
        "seconds": result.seconds,
        "entries": dict(result.entries),
        "beats": list(result.beats),
        "window": {
            "start": result.window_start.isoformat(),
            "end": result.window_end.isoformat(),
            "grace": result.grace,
        },
        "killed": dataclasses.asdict(result.killed),
        "claims_by_node": result.claims_by_node,
        "not_run_by_node": result.not_run_by_node,
        "keys_checked": result.keys_checked,
        "key_mismatches": result.key_mismatches,
        "drained": result.drained,
        "left_in_queue": result.left_in_queue,
        "workdir": str(result.workdir) if result.workdir is not None else None,
        "exit_status": result.exit_status,
    }
