"""The demo's report arithmetic, its ledger, its work folder and its command line (no process)."""

from __future__ import annotations

import contextlib
import json
import shutil
import sqlite3
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import ClassVar

import pytest

from celery_exactonce import __main__ as cli
from celery_exactonce.demo import app as demo_app
from celery_exactonce.demo import run as demo
from celery_exactonce.demo.report import (
    DemoResult,
    Execution,
    Kill,
    Slot,
    build_report,
    pick_examples,
    render_counts,
    report_json,
)

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def slots(entry: str, *seconds: float) -> list[Slot]:
    return [(entry, at(s)) for s in seconds]


def runs(entry: str, *seconds: float) -> list[Execution]:
    return [Execution(entry, at(s), f"eo1_{entry}_{s:g}") for s in seconds]


# -- build_report -----------------------------------------------------------------------


def test_a_clean_run_counts_every_slot_once_and_exits_0() -> None:
    # Given six due slots of two entries, each claimed once and run once
    due = slots("a", 1, 2, 3, 4) + slots("b", 2, 4)
    # When the report is built
    report = build_report(due, due, runs("a", 1, 2, 3, 4) + runs("b", 2, 4))
    # Then everything adds up and nothing ran twice
    assert (report.due, report.dispatched, report.executed) == (6, 6, 6)
    assert (report.duplicates, report.missed, report.outside_window) == (0, 0, 0)
    assert report.exit_status == 0


def test_a_slot_that_ran_twice_is_a_duplicate_and_exits_1() -> None:
    due = slots("a", 1, 2, 3)
    report = build_report(due, due, runs("a", 1, 2, 2, 3))
    assert report.duplicates == 1
    assert report.duplicate_slots == (("a", at(2)),)
    assert report.executed == 4  # every body run counts
    assert report.missed == 0
    assert report.exit_status == 1
    assert "FAILED" in render_counts(report, {})[-1]
    assert report_json(report)["exit_status"] == 1


def test_a_duplicate_outside_the_window_still_counts() -> None:
    # Given a slot before the window that ran twice
    due = slots("a", 2, 3)
    report = build_report(due, due + slots("a", 1), runs("a", 1, 1, 2, 3))
    # Then no choice of window hides it
    assert report.duplicates == 1
    assert report.outside_window == 2
    assert (report.due, report.dispatched, report.executed) == (2, 2, 2)
    assert report.exit_status == 1


def test_missed_slots_are_split_into_never_claimed_and_claimed_never_run() -> None:
    # Given four due slots: one never claimed, one claimed by a node killed before publishing
    due = slots("a", 1, 2, 3, 4)
    dispatched = slots("a", 1, 2, 3) + slots("a", 5)  # 5: after the window
    executed = runs("a", 1, 3, 5)
    # When the report is built
    report = build_report(due, dispatched, executed)
    # Then the missed slots are counted by cause, and runs after the window are apart
    assert (report.due, report.dispatched, report.executed) == (4, 3, 2)
    assert (report.missed, report.claimed_not_run, report.never_claimed) == (2, 1, 1)
    assert report.missed_slots == (("a", at(2)), ("a", at(4)))
    assert report.outside_window == 1
    assert report.exit_status == 0  # late or skipped (visibly) is allowed; twice is not
    missed_line = next(
        line for line in render_counts(report, {}, {"beat-a": 1}) if "missed" in line
    )
    assert "1 never claimed, 1 claimed and never run (claimed by beat-a 1)" in missed_line


def test_examples_show_one_key_per_entry_first() -> None:
    executed = runs("a", 1, 2, 3) + runs("b", 2) + runs("c", 3)
    chosen = pick_examples(executed)
    assert [(run.entry, run.fire_time) for run in chosen] == [
        ("a", at(1)),
        ("b", at(2)),
        ("c", at(3)),
    ]
    assert len(pick_examples(runs("a", 1, 2, 3, 4))) == 3
    assert pick_examples([]) == ()


# -- the ledger -------------------------------------------------------------------------


def test_ledger_lines_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    for second in (1, 2):
        demo_app.append_ledger(
            path,
            {
                "entry": "every-1s",
                "fire_time": f"2026-01-01T12:00:0{second}.000000Z",
                "idempotency_key": f"eo1_{second}",
            },
        )
    assert demo.read_ledger(path) == [
        Execution("every-1s", at(1), "eo1_1"),
        Execution("every-1s", at(2), "eo1_2"),
    ]
    assert demo.read_ledger(tmp_path / "absent.jsonl") == []


def test_a_line_that_is_not_a_ledger_record_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    path.write_text(json.dumps({"entry": "a"}) + "\n")
    with pytest.raises(demo.DemoError, match=r"ledger.jsonl:1: not a ledger line"):
        demo.read_ledger(path)


# -- the broker -------------------------------------------------------------------------


def test_the_broker_is_prepared_in_wal_mode_and_counts_waiting_messages(tmp_path: Path) -> None:
    # Given a prepared work folder (twice: it is idempotent)
    layout = demo_app.Layout(tmp_path / "demo")
    layout.prepare()
    layout.prepare()
    # Then the broker is a SQLite file in WAL mode, with the queue and no message
    assert layout.broker_url == f"sqla+sqlite:///{tmp_path / 'demo' / 'broker.db'}"
    with contextlib.closing(sqlite3.connect(layout.broker_db)) as db:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert layout.waiting_messages() == 0
    # When the demo app publishes two messages and a reader takes one
    app = demo_app.make_app(layout)
    sent = [app.send_task(demo_app.TASK, args=(name,), queue=demo_app.QUEUE) for name in "ab"]
    assert layout.waiting_messages() == 2
    with layout.broker() as channel:
        message = channel.basic_get(demo_app.QUEUE, no_ack=True)
    # Then the first came out whole, and one waits
    assert message.headers["id"] == sent[0].id
    assert layout.waiting_messages() == 1


# -- the work folder and the command line -----------------------------------------------


def fake_result() -> DemoResult:
    due = slots("every-1s", 1, 2, 3)
    return DemoResult(
        report=build_report(due, due, runs("every-1s", 1, 2, 3)),
        seconds=10.0,
        entries={"every-1s": 1.0},
        beats=("beat-a", "beat-b"),
        window_start=at(0.5),
        window_end=at(3.5),
        grace=1.5,
        killed=Kill("beat-a", 4321, 5.0),
        claims_by_node={"beat-a": 1, "beat-b": 2},
        not_run_by_node={},
        keys_checked=3,
        key_mismatches=0,
        drained=True,
        left_in_queue=0,
    )


class FakeDemo:
    """Stands in for :class:`demo.Demo`: records its folder, starts nothing."""

    folders: ClassVar[list[Path]] = []

    def __init__(self, layout: demo_app.Layout, seconds: float, progress: object) -> None:
        self.layout = layout

    def run(self) -> DemoResult:
        FakeDemo.folders.append(self.layout.workdir)
        assert self.layout.broker_db.is_file()
        return fake_result()


@pytest.fixture
def fake_demo(monkeypatch: pytest.MonkeyPatch) -> type[FakeDemo]:
    FakeDemo.folders = []
    monkeypatch.setattr(demo, "Demo", FakeDemo)
    return FakeDemo


def test_the_temporary_work_folder_is_removed_unless_kept(fake_demo: type[FakeDemo]) -> None:
    result = demo.run_demo(10)
    assert result.workdir is None
    assert not fake_demo.folders[-1].exists()
    kept = demo.run_demo(10, keep=True)
    assert kept.workdir == fake_demo.folders[-1]
    assert kept.workdir.is_dir()
    shutil.rmtree(kept.workdir)  # kept: the caller's to remove


def test_a_named_work_folder_is_kept_and_must_be_empty(
    fake_demo: type[FakeDemo], tmp_path: Path
) -> None:
    result = demo.run_demo(10, tmp_path / "new")
    assert result.workdir == (tmp_path / "new").resolve()
    assert (tmp_path / "new" / "broker.db").is_file()
    with pytest.raises(demo.DemoError, match="must be an empty folder"):
        demo.run_demo(10, tmp_path / "new")


def test_the_command_line_prints_the_report_and_its_status(
    fake_demo: type[FakeDemo], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert cli.main(["demo", "--seconds", "10", "--workdir", str(tmp_path / "h")]) == 0
    text = capsys.readouterr().out
    assert "beat-a (pid 4321) SIGKILLed at +5 s; beat-b carried on" in text
    assert "duplicates       0" in text
    assert "OK: no occurrence ran twice" in text
    assert cli.main(["demo", "--seconds", "10", "--json", "--workdir", str(tmp_path / "j")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["killed"] == {"node": "beat-a", "pid": 4321, "after": 5.0}
    assert data["report"]["duplicates"] == 0
    assert data["exit_status"] == 0


def test_a_run_too_short_to_kill_half_way_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--seconds", "2"]) == cli.CANNOT_RUN
    assert "--seconds must be at least 6" in capsys.readouterr().err
