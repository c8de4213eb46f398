"""Ids as beat makes them, prefixes, a repeated cancel and ``--json`` output, through the CLI.

Each test runs the real ``celery -A tests.cli.cli_app exactonce …`` command
(a subprocess) on a namespace seeded by :meth:`Deployment.seed`: its beat
occurrence has the id beat gives it (:func:`~celery_exactonce.beat.entries.occurrence_id`,
68 characters).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_exactonce.core.states import State
from tests.cli.cli_app import NIGHTLY
from tests.cli.conftest import Deployment
from tests.support.helpers import task_job

pytestmark = pytest.mark.timeout(120)

#: What a Python repr looks like in a value: ``<crontab: …>``, ``SomeClass(…)``,
#: ``datetime.datetime(…)``.
_REPR = re.compile(r"<[^<>]*>|\b[A-Z][A-Za-z0-9_]*\(|\bdatetime\.\w+\(")


def test_scenario_79_ids_as_long_as_beat_makes_them_go_whole_from_jobs_to_show_and_cancel(
    deployment: Deployment,
) -> None:
    """``jobs`` prints a beat id whole, ``show`` takes it, and a unique prefix of it.

    Before the fix every cell was cut at 60 characters, ``show``'s own
    ``task_id`` line included, so the 68-character id ``jobs`` printed ended
    in an ellipsis and ``show`` answered "no job" to it; a prefix was no job
    either.
    """
    made = deployment.seed()
    long_id = made["nightly"].id
    assert len(long_id) == 68

    listed = deployment.run("jobs", "--key", NIGHTLY).stdout
    printed = listed.splitlines()[1].split()[0]  # the first row's task id, as people copy it
    assert printed == long_id, listed

    shown = deployment.run("show", printed).stdout
    assert re.search(rf"^\s+task_id\s+{re.escape(long_id)}$", shown, re.MULTILINE), shown
    (job,) = deployment.json("show", long_id[:12])["jobs"]  # a prefix no other id starts with
    assert (job["task_id"], job["entry"]) == (long_id, NIGHTLY)

    # cancel takes a prefix too; one that several ids start with is bad usage, naming them
    cancelled = deployment.json("cancel", "j-pend")
    assert (cancelled["task_id"], cancelled["cancelled"]) == ("j-pending", True)
    ambiguous = deployment.run("cancel", "j-bill", expect=2)
    assert all(f"j-bill{i}" in ambiguous.stderr for i in range(3)), ambiguous.stderr
    still = deployment.store.get(made["bill0"])
    assert still is not None and still.state is State.SCHEDULED


@pytest.fixture
def sqlite_deployment(tmp_path: Path) -> Iterator[Deployment]:
    made = Deployment("sqlite", f"sqlite:///{tmp_path / 'json.db'}")
    yield made
    made.close()


def test_cancel_of_a_job_cancelled_already_succeeds_and_says_so(
    sqlite_deployment: Deployment,
) -> None:
    """What the caller wanted holds: exit 0, the state reported.

    Before the fix a second ``cancel`` of the same job exited 1 ("is
    CANCELLED: only a job not dispatched yet cancels"), as if it had failed.
    """
    deployment = sqlite_deployment
    deployment.seed()
    assert deployment.json("cancel", "j-pending")["cancelled"] is True
    again = deployment.json("cancel", "j-pending")
    assert again == {
        "task_id": "j-pending",
        "cancelled": False,
        "already_cancelled": True,
        "state": "CANCELLED",
    }
    assert "cancelled already" in deployment.run("cancel", "j-pending").stdout


def _values(data: Any) -> Iterator[Any]:
    if isinstance(data, dict):
        for key, value in data.items():
            yield key
            yield from _values(value)
    elif isinstance(data, list):
        for value in data:
            yield from _values(value)
    else:
        yield data


def test_json_output_never_holds_a_python_repr(sqlite_deployment: Deployment) -> None:
    """Every command's ``--json``: one JSON document, no value a Python repr.

    Before the fix ``schedule --json`` gave each entry's schedule as
    ``<crontab: 0 3 * * * (m/h/dM/MY/d)>``, and anything else JSON has no
    type for went out as its ``str()``, a repr as often as not.
    """
    d = sqlite_deployment
    d.seed()
    assert d.store.create(task_job("j-failed", State.RUNNING)).created
    documents = {
        args: d.json(*args)
        for args in (
            ("status",),
            ("jobs",),
            ("show", "j-pending"),
            ("schedule",),
            ("cancel", "j-pending"),
            ("reconcile",),
            ("check",),
        )
    }
    schedule = next(e for e in documents[("schedule",)]["entries"] if e["entry"] == NIGHTLY)
    assert schedule["schedule"].startswith("crontab: 0 3 * * *"), schedule
    found = {
        args: [v for v in _values(doc) if isinstance(v, str) and _REPR.search(v)]
        for args, doc in documents.items()
    }
    assert {args: bad for args, bad in found.items() if bad} == {}
