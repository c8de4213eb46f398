"""``exactonce schedule add|remove|pause|resume``: the stored entries from a shell, with the
real command (``celery -A APP exactonce …``).

Each command is a process start: the whole flow runs on Redis, PostgreSQL (whose URL
carries a password no output may show) and a Django project's database; the
refusals on SQLite. The stores themselves are held to the contract on every backend
(``tests/contract/test_entries.py``), the rules in ``tests/unit/beat/test_stored_entries.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.cli_app import NIGHTLY
from tests.cli.conftest import Deployment


def _entry(data: dict, name: str) -> dict:  # type: ignore[type-arg]
    return next(e for e in data["entries"] if e["entry"] == name)


@pytest.mark.parametrize("deployment", ["redis", "postgres", "django"], indirect=True)
def test_add_pause_resume_remove_show_in_schedule(deployment: Deployment, tmp_path: Path) -> None:
    deployment.seed()
    # add: saved, and listed with its next slots
    saved = deployment.json(
        "schedule", "add", "report", "cli_app.bill", "--cron", "*/5 * * * *", "--args", "[1]"
    )
    assert (saved["entry"], saved["schedule"], saved["paused"]) == (
        "report",
        {"cron": "*/5 * * * *", "tz": None},
        False,
    )
    listed = deployment.json("schedule", "--count", "2")
    report = _entry(listed, "report")
    assert (report["source"], report["paused"], report["error"]) == ("stored", False, None)
    assert len(report["next"]) == 2 and all(":00+00:00" in slot for slot in report["next"])
    assert _entry(listed, NIGHTLY)["source"] == "settings"
    # pause: listed as paused, with no next slot; resume: from now
    assert deployment.json("schedule", "pause", "report")["paused"] is True
    paused = _entry(deployment.json("schedule"), "report")
    assert (paused["paused"], paused["next"]) == (True, [])
    assert "paused" in deployment.run("schedule").stdout
    # (the group's --json serves its commands too)
    resumed = json.loads(deployment.run("schedule", "--json", "resume", "report").stdout)
    assert resumed["paused"] is False and resumed["since"] >= saved["since"]
    # remove: gone; removing again fails, naming it
    assert deployment.json("schedule", "remove", "report") == {"entry": "report", "removed": True}
    assert "report" not in {e["entry"] for e in deployment.json("schedule")["entries"]}
    again = deployment.run("schedule", "remove", "report", expect=1)
    assert "no stored entry 'report'" in again.stderr

    # Several at once: a file of entries, and several names
    batch = tmp_path / "entries.json"
    batch.write_text(
        json.dumps(
            [
                {"name": "a", "task": "cli_app.bill", "every": "10s", "args": ["a"]},
                {"name": "b", "task": "cli_app.mail", "cron": "0 4 * * *", "tz": "Europe/Berlin"},
            ]
        )
    )
    saved = deployment.json("schedule", "add", "--file", str(batch))["saved"]
    assert [(e["entry"], e["schedule"]) for e in saved] == [
        ("a", {"every": 10.0}),
        ("b", {"cron": "0 4 * * *", "tz": "Europe/Berlin"}),
    ]
    assert [e["paused"] for e in deployment.json("schedule", "pause", "a", "b")["entries"]] == [
        True,
        True,
    ]
    missing = deployment.run("schedule", "remove", "a", "nope", "b", expect=1)
    assert "no stored entry 'nope'" in missing.stderr
    deployment.run("schedule", "remove", "a", "b")
    assert deployment.store.read_entries()[1] == {}


@pytest.mark.parametrize("deployment", ["sqlite"], indirect=True)
def test_bad_input_is_refused_naming_it_and_stores_nothing(
    deployment: Deployment, tmp_path: Path
) -> None:
    deployment.seed()
    deployment.run("schedule", "add", "kept", "cli_app.bill", "--every", "30s")
    before = deployment.store.read_entries()
    bad_file = tmp_path / "bad.json"  # the second one is refused: neither is saved
    bad_file.write_text(
        json.dumps(
            [
                {"name": "x", "task": "cli_app.bill", "every": 5},
                {"name": "y", "task": "cli_app.bill", "cron": "0 25 * * *"},
            ]
        )
    )
    refusals = [
        (["add", NIGHTLY, "cli_app.bill", "--every", "60"], 1, f"'{NIGHTLY}'"),
        (["add", "x", "cli_app.bill", "--cron", "61 * * * *"], 1, "61"),
        (["add", "x", "cli_app.bill"], 2, "--every, --cron or --at"),
        (["add", "x", "cli_app.bill", "--every", "soon"], 2, "'soon' is not an age"),
        (["add", "x", "cli_app.bill", "--every", "5", "--args", "{"], 2, "--args is not JSON"),
        (["add", "x", "nobody.has.it", "--every", "5"], 1, "not registered"),
        (["add", "x", "cli_app.bill", "--at", "2026-05-01T03:00:00"], 2, "--at"),
        (["pause", "nope"], 1, "no stored entry 'nope'"),
        (["add", "--file", str(bad_file)], 1, "'y'"),
    ]
    for args, code, match in refusals:
        done = deployment.run("schedule", *args, expect=code)
        assert match in done.stderr, (args, done.stderr)
    assert deployment.store.read_entries() == before
