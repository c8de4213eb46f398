"""``python -m celery_exactonce``: the command line of the package (``demo`` for now).

``python -m celery_exactonce demo`` runs two beat nodes and a worker on this
machine with no server (SQLite store and broker), SIGKILLs one beat
half-way through and prints a report; see :mod:`celery_exactonce.demo`.
Exit status: 0, 1 when any occurrence ran twice, 2 when the demo could not
run, 130 when interrupted (Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import IO

from celery_exactonce.core import exceptions
from celery_exactonce.demo import report as demo_report
from celery_exactonce.demo import run as demo

#: Exit status when the demo could not run (1 means "an occurrence ran twice").
CANNOT_RUN = 2
#: Exit status after Ctrl-C (128 + SIGINT), as a shell reports it.
INTERRUPTED = 130


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m celery_exactonce``."""
    root = argparse.ArgumentParser(
        prog="python -m celery_exactonce",
        description="celery-exactonce: at-most-once dispatch for Celery.",
    )
    commands = root.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run = commands.add_parser(
        "demo",
        help="two beat nodes and a worker on this machine, no servers; ends with a report",
        description=(
            "Run two leaderless beat nodes and a worker (SQLite store and broker), "
            "SIGKILL one beat half-way through, then report the occurrences due, "
            "dispatched, executed, duplicated and missed. Exits 1 if any occurrence "
            "ran twice, 2 if the demo could not run."
        ),
    )
    run.add_argument(
        "--seconds",
        type=float,
        default=30.0,
        help="how long the beats run, from the first claimed slot (default: 30)",
    )
    run.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="an empty or new folder for the store, broker, ledger and logs; kept at the end "
        "(default: a fresh temporary folder, removed at the end)",
    )
    run.add_argument(
        "--keep", action="store_true", help="keep the temporary work folder, and say where"
    )
    run.add_argument("--json", action="store_true", help="print the report as JSON")
    return root


def run_demo(args: argparse.Namespace, out: IO[str] = sys.stdout) -> int:
    """``demo``: run it, print the report (progress goes to stderr); the exit status."""

    def progress(line: str) -> None:
        print(f"demo: {line}", file=sys.stderr, flush=True)

    try:
        result = demo.run_demo(args.seconds, args.workdir, keep=args.keep, progress=progress)
    except exceptions.ExactOnceError as exc:  # DemoError, or the store's own (no SQLAlchemy)
        print(f"demo: error: {exc}", file=sys.stderr)
        return CANNOT_RUN
    if args.json:
        json.dump(demo_report.result_json(result), out, indent=2)
        out.write("\n")
    else:
        print(demo_report.render(result), file=out)
    return result.exit_status


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; the exit status.

    SIGTERM is handled as Ctrl-C: the demo's processes are stopped and its
    temporary folder removed before the command exits.
    """
    args = parser().parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return run_demo(args, sys.stdout)
    except KeyboardInterrupt:
        print("demo: interrupted", file=sys.stderr)
        return INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
