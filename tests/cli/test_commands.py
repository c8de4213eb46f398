"""Every ``celery -A APP exactonce`` command on every shared store, in table and ``--json`` form.

Each test runs the real command (a subprocess, through Celery's
``celery.commands`` entry point) on a namespace seeded with known jobs
(:meth:`Deployment.seed`): one delayed job (``j-pending``, ``cli_app.mail``),
three ``SCHEDULED`` ones (``j-bill0..2``, ``cli_app.bill``), one occurrence of
the beat entry ``nightly-billing`` at ``FIRE``, ``DISPATCHED`` (the entry's
watermark), and one record of skipped slots. Fails before the CLI existed:
``No such command 'exactonce'``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.reconcile.passes import lease_token
from celery_exactonce.reconcile.reconciler import LEASE_NAME
from celery_exactonce.stores import redact_url
from celery_exactonce.stores.base import format_written
from celery_exactonce.stores.sql.schema import SCHEMA_VERSION
from tests.cli.cli_app import NIGHTLY
from tests.cli.conftest import FIRE, Deployment

pytestmark = pytest.mark.timeout(120)


def test_status_counts_states_and_shows_entries_skips_and_the_lease(
    deployment: Deployment,
) -> None:
    made = deployment.seed()
    token = lease_token("other-node")
    assert deployment.store.acquire_lease(LEASE_NAME, token, 60)

    data = deployment.json("status")
    assert data["namespace"] == deployment.namespace
    assert {k: v for k, v in data["jobs"].items() if v} == {
        "PENDING": 1,
        "SCHEDULED": 3,
        "DISPATCHED": 1,
    }
    assert data["oldest"]["PENDING"]["task_id"] == "j-pending"
    assert data["oldest"]["SCHEDULED"]["task_id"] == "j-bill0"
    assert data["oldest"]["RUNNING"] is None
    nightly = next(e for e in data["entries"] if e["entry"] == NIGHTLY)
    assert nightly["watermark"] == FIRE.isoformat()
    assert nightly["last_state"] == "DISPATCHED"
    assert [(r["entry"], r["where"], r["count"]) for r in data["skipped"]] == [
        (NIGHTLY, "catchup", 3)
    ]
    assert data["reconciler"]["lease_holder"] == "other-node"

    text = deployment.run("status").stdout
    assert "SCHEDULED   3" in text
    # whole, once: in the oldest live jobs; the entry's table shows its state, not ids
    assert text.count(made["nightly"].id) == 1
    assert NIGHTLY in text and "other-node" in text and "catchup" in text


def test_jobs_filter_by_state_task_key_and_age_and_page_on(deployment: Deployment) -> None:
    made = deployment.seed()

    def ids(*args: str) -> list[str]:
        return [job["task_id"] for job in deployment.json("jobs", *args)["jobs"]]

    assert ids("--state", "pending") == ["j-pending"]
    assert ids("--state", "SCHEDULED", "--task", "cli_app.bill") == [
        "j-bill0",
        "j-bill1",
        "j-bill2",
    ]
    assert ids("--key", NIGHTLY) == [made["nightly"].id]
    assert ids("--task", "cli_app.mail", "--state", "scheduled") == []
    assert ids("--older-than", "1h") == []
    # Every job once, a page of two at a time, in State order then oldest touched first
    seen, cursor = [], None
    for _ in range(5):
        page = deployment.json("jobs", "--limit", "2", *(["--cursor", cursor] if cursor else []))
        seen += [job["task_id"] for job in page["jobs"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == ["j-pending", "j-bill0", "j-bill1", "j-bill2", made["nightly"].id]

    text = deployment.run("jobs", "--state", "scheduled", "--limit", "2").stdout
    assert "j-bill0" in text and "j-bill1" in text and "j-bill2" not in text
    assert "more: --cursor SCHEDULED:" in text


def test_show_prints_the_record_and_its_history(deployment: Deployment) -> None:
    made = deployment.seed()
    occurrence = made["nightly"].id
    (job,) = deployment.json("show", occurrence)["jobs"]
    assert (job["entry"], job["state"], job["fire_time"]) == (
        NIGHTLY,
        "DISPATCHED",
        FIRE.isoformat(),
    )
    assert [(h["from"], h["to"]) for h in job["history"]] == [
        (None, "SCHEDULED"),
        ("SCHEDULED", "DISPATCHED"),
    ]
    text = deployment.run("show", "j-pending").stdout
    assert "cli_app.mail" in text and "history" in text and "PENDING" in text

    missing = deployment.run("show", "no-such-job", expect=1)
    assert "no job 'no-such-job'" in missing.stderr


def test_schedule_shows_next_slots_and_the_last_claimed_occurrence(
    deployment: Deployment,
) -> None:
    deployment.seed()
    data = deployment.json("schedule", "--count", "2")
    nightly = next(e for e in data["entries"] if e["entry"] == NIGHTLY)
    assert len(nightly["next"]) == 2
    assert all(slot.endswith("T03:00:00+00:00") for slot in nightly["next"])
    assert (nightly["last_claimed"], nightly["last_state"]) == (FIRE.isoformat(), "DISPATCHED")
    assert {e["entry"] for e in data["entries"]} == {NIGHTLY, "celery_exactonce.reconcile"}

    text = deployment.run("schedule").stdout
    assert NIGHTLY in text and "DISPATCHED" in text and "03:00:00" in text


def test_cancel_reconcile_and_migrate(deployment: Deployment) -> None:
    made = deployment.seed()
    assert deployment.json("cancel", "j-pending") == {
        "task_id": "j-pending",
        "cancelled": True,
        "already_cancelled": False,
        "state": "CANCELLED",
    }
    job = deployment.store.get(JobRef.submitted("j-pending"))
    assert job is not None and job.state is State.CANCELLED
    again = deployment.run("cancel", "j-pending")  # cancelled already: what was wanted holds
    assert "CANCELLED" in again.stdout
    occurrence = deployment.run("cancel", made["nightly"].id, expect=1)
    assert "beat occurrence" in occurrence.stderr

    # A pass while another node holds the lease does not run: exit 1, saying so
    token = lease_token("other-node")
    assert deployment.store.acquire_lease(LEASE_NAME, token, 60)
    held = deployment.run("reconcile", expect=1)
    assert "another node holds" in held.stderr
    assert deployment.store.release_lease(LEASE_NAME, token)
    report = deployment.json("reconcile")
    assert report["ran"] is True and report["errors"] == 0
    assert "pass: " in deployment.run("reconcile").stdout

    written = format_written(deployment.store)  # the SQL schema's 2, the Redis format's 1
    assert written == (1 if deployment.backend == "redis" else SCHEMA_VERSION)
    assert deployment.json("migrate") == {
        "store": deployment.json("migrate")["store"],
        "namespace": deployment.namespace,
        "before": written,
        "after": written,
        "format": written,
    }
    assert "nothing to do" in deployment.run("migrate").stdout


def test_check_passes_on_a_set_up_store(deployment: Deployment) -> None:
    deployment.seed()
    data = deployment.json("check")
    assert data["ok"] is True
    status = {check["name"]: check["status"] for check in data["checks"]}
    assert status["store reachable"] == status["schema"] == status["settings"] == "ok"
    assert status["signing"] == "warn"  # no exactonce_signing_key
    assert status["one host"] == ("warn" if deployment.backend in ("sqlite", "django") else "ok")
    gated = next(c for c in data["checks"] if c["name"] == "gated tasks")
    assert "cli_app.bill" in gated["message"]
    assert data["settings"]["namespace"] == deployment.namespace
    assert data["settings"]["store_url"] == redact_url(deployment.cli_url)

    deployment.conf = {"exactonce_signing_key": "k" * 32}
    text = deployment.run("check").stdout
    assert "all checks passed" in text
    assert all(line.startswith(("ok", "warn", "all")) for line in text.splitlines()), text


def test_migrate_sets_up_a_store_that_check_found_never_set_up(tmp_path: Path) -> None:
    fresh = Deployment("sqlite", f"sqlite:///{tmp_path / 'fresh.db'}")
    try:
        schema = next(c for c in fresh.json("check")["checks"] if c["name"] == "schema")
        assert schema["status"] == "warn" and "migrate" in schema["message"]
        unread = fresh.run("status", expect=1)
        assert "never set up" in unread.stderr and "migrate" in unread.stderr
        assert fresh.json("migrate")["before"] is None
        assert fresh.store.schema_version() == SCHEMA_VERSION
        schema = next(c for c in fresh.json("check")["checks"] if c["name"] == "schema")
        assert schema["status"] == "ok"
        assert fresh.json("status")["jobs"]["PENDING"] == 0
    finally:
        fresh.close()
