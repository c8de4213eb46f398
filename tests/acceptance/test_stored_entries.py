"""Stored entries edited through the CLI while three real beats run: SCENARIOS 73's shape.

Three ``celery beat -S exactonce`` processes (no ``beat_schedule`` entries of
their own) and a worker. Two hundred entries are added with ``celery exactonce
schedule add --file``, every ten seconds; after two slots, fifty are re-timed
to every fifteen seconds (``add --file`` again), fifty paused and fifty removed
(``pause`` and ``remove`` with their names), fifty left alone. Then:

* every beat read each change within a tick (its ``schedule_reloaded`` event
  carries the revision it read);
* no ``(entry, slot)`` ran twice, anywhere in the run;
* every slot of the unchanged entries, and every slot of the re-timed ones on
  their new grid, ran once over the measured window;
* a paused or removed entry ran no slot after its change, a re-timed one no
  slot of its old grid after its change.

The default run takes the Redis store; PostgreSQL runs under ``-m slow``. The
rules are held in-process on every node order in
``tests/unit/beat/test_stored_entries.py``, the stores' side on every backend in
``tests/contract/test_entries.py``.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from tests.acceptance import beats as b
from tests.acceptance.harness import BeatProcess, Deployment, Ledger, poll

ENTRIES = 200
EVERY, RETIMED_EVERY = 10, 15
#: Store-time seconds the entries run before the edits, and after them.
BEFORE_EDITS, AFTER_EDITS = 22, 36
#: Slots this close to the stop are outside the window (the beats are stopped by SIGKILL).
END_MARGIN = 3
#: Wall-clock seconds within which every beat must have read a change: its next tick
#: (``exactonce_tick_interval``, 1 s) and a little for a loaded machine.
READ_WITHIN = 5.0


def names(indexes: range) -> list[str]:
    return [f"stored-{i:03}" for i in indexes]


RETIMED, PAUSED, REMOVED, KEPT = (names(range(i, i + 50)) for i in (0, 50, 100, 150))


def add_file(path: Path, entries: list[str], every: int) -> Path:
    specs = [{"name": n, "task": "plain_beat", "every": every, "args": [n]} for n in entries]
    path.write_text(json.dumps(specs))
    return path


def read_by_every_beat(deployment: Deployment, beats: list[BeatProcess]) -> float:
    """Wall seconds until every beat logged reading the store's current revision."""
    revision = deployment.store().entries_revision()
    began = time.monotonic()

    def everyone() -> bool:
        return all(
            any(e.get("revision", -1) >= revision for e in beat.events("schedule_reloaded"))
            for beat in beats
        )

    poll(everyone, timeout=READ_WITHIN + 30, interval=0.05)
    return time.monotonic() - began


def grid(start: datetime, end: datetime, every: int) -> list[datetime]:
    """The slots of an every-``every``-seconds interval in ``(start, end]``."""
    first = int(start.timestamp()) // every * every + every
    return [
        datetime.fromtimestamp(t, start.tzinfo)
        for t in range(first, int(end.timestamp()) + 1, every)
    ]


@pytest.mark.timeout(300)
@pytest.mark.acceptance_matrix(
    brokers=("redis",), stores=("redis", "postgres"), slow_stores=("postgres",)
)
def test_scenario_73_shape_stored_entries_edited_through_the_cli_while_three_beats_run(
    deployment: Deployment, ledger: Ledger, tmp_path: Path
) -> None:
    # SCENARIOS 73 on stored entries: edits apply on every node within a tick, past slots
    # never re-fire, every slot once
    deployment.start_worker(concurrency=4)
    beats = b.start_beats(deployment, [{}, {}, {}], entries=0, every=0)

    # Given 200 entries added through the CLI while three beats run
    first_file = add_file(tmp_path / "a.json", names(range(ENTRIES)), EVERY)
    deployment.exactonce("schedule", "add", "--file", str(first_file))
    added = b.store_now(deployment)
    waits = [read_by_every_beat(deployment, beats)]
    b.run_until(deployment, added + timedelta(seconds=BEFORE_EDITS), beats)

    # When fifty are re-timed, fifty paused and fifty removed, through the CLI
    edits: dict[str, tuple[datetime, datetime]] = {}
    for what, args in (
        ("retimed", ["add", "--file", str(add_file(tmp_path / "r.json", RETIMED, RETIMED_EVERY))]),
        ("paused", ["pause", *PAUSED]),
        ("removed", ["remove", *REMOVED]),
    ):
        before = b.store_now(deployment)
        deployment.exactonce("schedule", *args)
        edits[what] = (before, b.store_now(deployment))
        waits.append(read_by_every_beat(deployment, beats))
    edited = edits["removed"][1]
    b.run_until(deployment, edited + timedelta(seconds=AFTER_EDITS), beats)
    for beat in beats:
        beat.kill()
    window_end = b.store_now(deployment) - timedelta(seconds=END_MARGIN)

    # Then every beat read every change within a tick or so
    print(f"seconds until all three beats read each change: {[round(w, 2) for w in waits]}")
    assert max(waits) <= READ_WITHIN, f"seconds until every beat read a change: {waits}"
    # And every slot of the window ran once: the kept entries on their grid from the add,
    # the re-timed ones on their new grid from the edit
    # the entries' first slots come after their save, and after the claim floor of the
    # store's epoch (born at the beats' first tick): no slot before it is ever claimed
    start = max(added, b.claim_floor(deployment)) + timedelta(seconds=1)
    expected = {(n, f) for n in KEPT for f in grid(start, window_end, EVERY)}
    expected |= {
        (n, f) for n in RETIMED for f in grid(edits["retimed"][1], window_end, RETIMED_EVERY)
    }
    b.wait_executed(ledger, expected)
    print(f"{len(expected)} slots expected in the window, {len(ledger.occurrences())} runs")
    b.assert_each_ran_once(deployment, ledger, expected)
    # And none of a changed entry's slots after its change came from what it was before
    ran = set(ledger.occurrences())
    for what, group, allowed in (
        ("retimed", RETIMED, RETIMED_EVERY),
        ("paused", PAUSED, None),
        ("removed", REMOVED, None),
    ):
        after = [(n, f) for n, f in ran if n in group and f > edits[what][1]]
        wrong = [(n, f) for n, f in after if allowed is None or f.timestamp() % allowed]
        assert not wrong, f"{what}: {len(wrong)} slot(s) after the change, e.g. {wrong[:3]}"
    # And before the edits, every entry ran on its first grid
    first = {(n, f) for n in names(range(ENTRIES)) for f in grid(start, edits["retimed"][0], EVERY)}
    assert first <= ran, f"{len(first - ran)} slot(s) before the edits never ran"
