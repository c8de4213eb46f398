"""The evidence page: what we promise, against what real runs measured.

``python -m tests.evidence`` runs each chaos run of :data:`RUNS` and its
control (a stock scheduler, or a plain ``Task``) as the test suite runs them,
one at a time, each test's output kept in ``docs/evidence/logs/``; with
``EXACTONCE_EVIDENCE_DIR`` set, every test that uses a deployment (the
acceptance harness) writes its figures there as it ends
(:func:`record_deployment`): the bodies the ledger saw run, the runs of
one job or one slot beyond the first, what the beats published and skipped
and what the gate suppressed, counted from the ledger and the processes'
own event logs. Then it writes ``docs/evidence.md``: each run, its
promise, its figures and its control's, the commit and the machine.

Every figure on the page is a count of lines in the run's ledger or logs,
and the test's own assertions held on the same run (its outcome is on the
page).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: Where the page, the figures and the logs go.
PAGE = ROOT / "docs" / "evidence.md"
FIGURES = ROOT / "docs" / "evidence" / "figures"
LOGS = ROOT / "docs" / "evidence" / "logs"
OUTCOMES = ROOT / "docs" / "evidence" / "outcomes.json"
VARIABLE = "EXACTONCE_EVIDENCE_DIR"


@dataclasses.dataclass(frozen=True)
class Run:
    """One chaos run: what it shows, its test, and the control run beside it."""

    name: str
    promise: str
    test: str
    control: str | None = None
    control_shows: str = ""


A = "tests/acceptance/"
RUNS = (
    Run(
        "Three beats, one SIGKILLed and restarted twice",
        "each scheduled slot is dispatched once, whatever beat dies",
        A + "test_beat.py::test_three_beats_run_every_slot_once_through_sigkills_and_restarts"
        "[redis-redis]",
        A + "test_django_beat.py::test_control_two_stock_django_celery_beat_schedulers_run_each"
        "_occurrence_twice[redis-redis-sqlite]",
        "two stock django-celery-beat schedulers: each occurrence runs twice",
    ),
    Run(
        "The Redis store restarted empty mid-run",
        "a store that lost its data makes beat skip, visibly, never run a slot twice",
        A + "test_beat_faults.py::test_redis_store_restarted_empty_mid_run_runs_no_slot_twice"
        "[redis-redis]",
    ),
    Run(
        "Three beats through two Sentinel failovers",
        "a failover loses no slot to a double run",
        A + "test_sentinel_failover.py::test_three_beats_through_two_sentinel_failovers"
        "[redis-redis-1]",
    ),
    Run(
        "Skewed and jumping node clocks",
        "clock skew within exactonce_max_skew neither doubles nor drops a slot",
        A + "test_beat_faults.py::test_skewed_and_jumping_node_clocks_neither_double_nor_drop_a"
        "_slot[redis-redis]",
    ),
    Run(
        "Every message delivered twice to a prefork worker",
        "a redelivered message never runs a gated body twice",
        A + "test_gate.py::test_prefork_many_jobs_each_delivered_twice_run_once_each[redis-redis]",
        A + "tooling/test_harness.py::test_redis_visibility_timeout_runs_a_plain_body_twice"
        "[redis-redis]",
        "a plain Task past Redis's visibility timeout: its body runs twice",
    ),
    Run(
        "A worker SIGKILLed mid-body",
        "a body that may have run is not run again by the redelivery",
        A + "test_gate.py::test_worker_killed_mid_body_is_not_run_again[redis-redis]",
        A + "tooling/test_harness.py::test_sigkilled_worker_mid_body_redelivers_to_a_new_worker"
        "[redis-redis]",
        "a plain Task: the redelivered message runs the body again",
    ),
    Run(
        "Charges while workers are SIGKILLed (exactonce_atomic)",
        "a body's database effects are made exactly once",
        A + "test_payments_atomic.py::test_atomic_charges_are_made_exactly_once_while_workers"
        "_are_killed",
        A + "test_payments_atomic.py::test_the_readme_run_of_1000_charges_and_its_controls[plain]",
        "1,000 charges by a plain Task under the same kills: some are made twice",
    ),
    Run(
        "Unique submissions: ten submitters, a crashed holder",
        "one live job per key; a crashed holder frees its key through the reconciler",
        A + "test_unique.py::test_ten_submitters_get_the_live_job_and_a_crashed_holder_frees_its"
        "_key[redis]",
        A + "test_unique.py::test_control_celery_once_keeps_a_crashed_holders_lock_until_its_ttl",
        "celery-once under the same crash: its lock refuses calls for the rest of its hour",
    ),
)


def record_deployment(node: str, outcome: str | None, deployment: Any) -> None:
    """Write a deployment's figures for the test ``node`` (if ``EXACTONCE_EVIDENCE_DIR`` is set)."""
    where = os.environ.get(VARIABLE)
    if not where:
        return
    ledger = deployment.ledger
    runs = Counter((row.task_id, row.attempt) for row in ledger.rows(phase=("run", "start")))
    slots = ledger.occurrences()
    events: Counter[str] = Counter()
    for beat in deployment.beats:
        events.update(str(event.get("action")) for event in beat.events())
    figures = {
        "test": node,
        "outcome": outcome,
        "bodies run": sum(runs.values()),
        "runs beyond the first (one job and attempt)": sum(n - 1 for n in runs.values()),
        "slots run": len(slots),
        "slot runs beyond the first": sum(n - 1 for n in slots.values()),
        "published by beats": events["dispatched"],
        "slots counted skipped": events["slot_skipped_entry"],
        "beat ticks failed closed": events["fail_closed"],
        "deliveries the gate suppressed": deployment.skipped_deliveries(),
    }
    path = Path(where) / f"{_slug(node)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=1) + "\n", encoding="utf-8")


def _slug(node: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", node.split("::", 1)[-1]).strip("-")[:120]


def run_test(node: str) -> tuple[str, float]:
    """Run one test as the suite does (slow ones included), its output to its log."""
    LOGS.mkdir(parents=True, exist_ok=True)
    FIGURES.mkdir(parents=True, exist_ok=True)
    log = LOGS / f"{_slug(node)}.log"
    env = {**os.environ, VARIABLE: str(FIGURES)}
    started = time.monotonic()
    argv = [sys.executable, "-m", "pytest", "-p", "no:celery", "-n", "0", "-s", "-rA"]
    argv += ["-m", "slow or not slow", node]
    with open(log, "w", encoding="utf-8") as out:
        done = subprocess.run(
            argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, check=False
        )
    return ("passed" if done.returncode == 0 else "FAILED"), time.monotonic() - started


def figures_of(node: str) -> dict[str, Any]:
    path = FIGURES / f"{_slug(node)}.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


#: The lines of pytest's own in a test's output (the rest is what the test printed).
PYTEST_LINES = re.compile(
    r"^(platform |cachedir:|django: |rootdir:|configfile:|plugins:|timeout|collected |"
    r"created:|=|PASSED|FAILED|SKIPPED|ERROR|[.sFE]+ *(\[|$)|\d+\.\d+s (call|setup|teardown)|"
    r"\(\d+ durations|tests/)"
)


#: A record of the captured log (pytest's ``-rA`` sections), not the test's own output.
LOG_LINE = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL)\s")


def printed(node: str) -> list[str]:
    """The figures a test printed: its own output's lines that hold a number."""
    log = LOGS / f"{_slug(node)}.log"
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines() if log.exists() else []
    own = []
    for line in lines:  # a test's output follows its file's name on pytest's progress line
        text = re.sub(r"^tests/\S+\.py\s*", "", line.strip())
        text = re.sub(r"\s*[.sFE]*$", "", text) if text.endswith((".", "s")) else text
        if text and not PYTEST_LINES.match(text) and not LOG_LINE.match(text):
            own.append(text)
    return [line for line in own if re.search(r"\d", line)][:8]


def cell(figures: dict[str, Any]) -> str:
    shown = [f"{k}: {v:,}" for k, v in figures.items() if isinstance(v, int) and v]
    return "; ".join(shown) or "(no deployment figures: see its printed lines)"


def render(outcomes: dict[str, tuple[str, float]]) -> str:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
        check=False,
    ).stdout.strip()  # fmt: skip
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "celery_exactonce", "tests"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    machine = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python "
    machine += platform.python_version()
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [
        "# Evidence: what we promise, and what real runs measured",
        "",
        "Each row is a real run: real `celery beat` and `celery worker` processes, real",
        "Redis (and PostgreSQL), faults injected as the row says; beside it, where one",
        "exists, the same run with the stock scheduler or a plain `Task`. The figures",
        "are counts from the run's ledger (one row per body run) and the processes'",
        "event logs; the run's own assertions held on the same run. Each run's whole",
        "output is in `docs/evidence/logs/`, its figures in `docs/evidence/figures/`.",
        "Slots counted skipped are the ones a beat decided not to run and said so: before",
        "a new namespace's first claim (its claim floor), or missed while no beat could",
        "claim them (the catch-up policy's), never a slot run elsewhere.",
        "",
        f"Generated by `python -m tests.evidence` on {now}, commit `{commit}`"
        + (" (with uncommitted changes)" if dirty else "")
        + f", on {machine}.",
        "",
    ]
    for run in RUNS:
        outcome, seconds = outcomes.get(run.test, ("not run", 0.0))
        out += [f"## {run.name}", "", f"**Promise:** {run.promise}.", ""]
        out += [f"* **Run** ({outcome}, {seconds:.0f} s; `{run.test}`):"]
        out += [f"  {cell(figures_of(run.test))}"]
        out += [f"  - {line}" for line in printed(run.test)]
        out += [f"  - log: `docs/evidence/logs/{_slug(run.test)}.log`"]
        if run.control is not None:
            outcome, seconds = outcomes.get(run.control, ("not run", 0.0))
            out += [f"* **Control**: {run.control_shows} ({outcome}, {seconds:.0f} s;"]
            out += [f"  `{run.control}`): {cell(figures_of(run.control))}"]
            out += [f"  - {line}" for line in printed(run.control)]
            out += [f"  - log: `docs/evidence/logs/{_slug(run.control)}.log`"]
        out.append("")
    return "\n".join(out)


def main() -> int:
    """Run every test and write the page; ``--render``: the page from the last run's files."""
    outcomes: dict[str, tuple[str, float]] = {}
    if "--render" in sys.argv[1:]:
        PAGE.write_text(render(json.loads(OUTCOMES.read_text(encoding="utf-8"))), "utf-8")
        return 0
    for run in RUNS:
        for node in filter(None, (run.test, run.control)):
            print(f"running {node}", flush=True)
            outcomes[node] = run_test(node)
            print(f"  {outcomes[node][0]} in {outcomes[node][1]:.0f} s", flush=True)
    OUTCOMES.write_text(json.dumps(outcomes, indent=1) + "\n", encoding="utf-8")
    PAGE.write_text(render(outcomes), encoding="utf-8")
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0 if all(outcome == "passed" for outcome, _ in outcomes.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
