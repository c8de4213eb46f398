"""``python -m tests.benchmarks --suite all --small`` runs every suite to the end.

The benchmarks' own smoke test, so that they cannot rot between the runs that
take their figures: the run must exit 0 and print every suite's table. No
timing is asserted (a shared CI machine's figures mean nothing); the summary
must hold the rows of the SQL stores it measured. It needs
Redis, which every suite but ``stores`` runs on: skipped locally without it,
failed under ``EXACTONCE_REQUIRE_SERVICES=1``. The other services' rows are
skipped by the run itself, the reason printed, where they do not answer; under
``EXACTONCE_REQUIRE_SERVICES=1`` such a skip fails the test too.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import services

ROOT = Path(__file__).resolve().parents[2]
#: About 30 s on a 2-core machine; generous for a loaded CI machine.
TIMEOUT = 240
#: A line that only the end of each suite's table prints.
TABLES = {
    "stores": "store operations per second",
    "beat": "beat / plain, median of",
    "entries": "tick ratio 2,000 / 200 entries",
    "claims": "beat's claims, 1,000 slots",
    "shards": "store ceiling: claims per CPU second",
    "delayed": "reconcile large / small",
    "submit": "redis / redis",
    "e2e": "prefork, queued first",
    "group": "(signatures/s)",
    "footprint": "measured / formula",
    "summary": "ours against plain Celery, this run",
}
#: Rows of the summary that need PostgreSQL (the SQL store's paths of the suites).
POSTGRES_ROWS = {
    "summary: submit on django://": "django:// (PostgreSQL) store / Redis broker",
    "summary: e2e on PostgreSQL": "prefork -c 2, PostgreSQL store",
    "summary: beat on PostgreSQL": "entries due at once, one beat, PostgreSQL",
}


def test_every_suite_runs_small() -> None:
    # Given Redis (and whichever other services answer)
    services.need("redis")
    # When every suite runs at its small size
    argv = [sys.executable, "-m", "tests.benchmarks", "--suite", "all", "--small"]
    pythonpath = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath)},
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # unwinds: the e2e worker is stopped, keys removed
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise AssertionError(f"ran over {TIMEOUT} s; output:\n{out}\nstderr:\n{err}") from None
    print(out)
    print(err, file=sys.stderr)
    # Then it ends well, having printed every suite's table
    assert proc.returncode == 0, f"exit status {proc.returncode}; stderr:\n{err}"
    tables = {**TABLES, **(POSTGRES_ROWS if services.answers("postgres") else {})}
    missing = [suite for suite, line in tables.items() if line not in out]
    assert not missing, f"no table of {missing}"
    # And with the services required, no row was skipped for want of one
    if services.required():
        skipped = [line for line in out.splitlines() if "skipped" in line]
        assert not skipped, skipped


def test_a_run_takes_some_suites_by_name_and_names_an_unknown_one() -> None:
    from tests.benchmarks.__main__ import SUITES, _suites

    # Some suites, in any order, run in the order of the full run; "all" is every one
    assert _suites("footprint, submit,e2e") == ("submit", "e2e", "footprint")
    assert _suites("all") == SUITES
    # An unknown name is refused, named, with the choices
    for bad, named in (("submit,bogus", "bogus"), (",", "','")):
        with pytest.raises(argparse.ArgumentTypeError, match=named) as refused:
            _suites(bad)
        assert "footprint" in str(refused.value)
