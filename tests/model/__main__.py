"""Run the model: ``python -m tests.model [--full] [--variant NAME] [--trace] [--jobs N]``.

Prints the comparison with ``celery_exactonce.core.states``, then each variant's
verdict within its bounds (its small ones; ``--full``: each of its wider
ones); exits 1 if a verdict is not the one expected, or the table differs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import multiprocessing
import time

from .scope import VARIANTS, differences, run
from .world import Bounds, Result

Job = tuple[str, Bounds]


def _search(job: Job) -> tuple[Job, Result, float]:
    started = time.process_time()
    result = run(*job)
    return job, result, time.process_time() - started


def _bounds(bounds: Bounds) -> str:
    return (
        f"faults={bounds.faults} passes={bounds.passes} reconcilers={bounds.reconcilers} "
        f"dups={bounds.dups} retries={bounds.retries}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.model", description=__doc__)
    parser.add_argument(
        "--variant",
        action="append",
        choices=sorted(VARIANTS),
        help="a variant to search (repeatable; default: all)",
    )
    parser.add_argument("--full", action="store_true", help="the wider bounds of each variant")
    parser.add_argument("--trace", action="store_true", help="print each counterexample")
    parser.add_argument("--jobs", type=int, default=1, help="searches run side by side")
    for knob in ("faults", "passes", "reconcilers"):
        parser.add_argument(f"--{knob}", type=int, help=f"override every search's {knob}")
    args = parser.parse_args(argv)
    override = {k: getattr(args, k) for k in ("faults", "passes", "reconcilers")}
    override = {k: v for k, v in override.items() if v is not None}
    jobs: list[Job] = []
    for name in args.variant or list(VARIANTS):
        variant = VARIANTS[name]
        for bounds in variant.full if args.full else (variant.bounds,):
            jobs.append((name, dataclasses.replace(bounds, **override)))
    # The largest searches first, so that side by side they end together: the
    # baselines (the others stop at their first violation), the opt-ins' first.
    jobs.sort(
        key=lambda job: (VARIANTS[job[0]].breaks is not None, not VARIANTS[job[0]].scenario.rerun)
    )
    unexpected = 0
    for problem in differences():
        print(f"table: {problem}")
        unexpected += 1
    started = time.monotonic()
    with multiprocessing.Pool(args.jobs) if args.jobs > 1 else contextlib.nullcontext() as pool:
        # Side by side, each verdict is printed as its search ends.
        done = pool.imap_unordered(_search, jobs) if pool is not None else map(_search, jobs)
        for (name, bounds), result, took in done:
            expect = VARIANTS[name].breaks
            found = result.violation.split(":")[0] if result.violation else None
            verdict = "PASS" if found is None else f"FAIL {found} in {len(result.trace)} steps"
            ok = found == expect and not result.stuck
            unexpected += not ok
            print(
                f"{name} [{_bounds(bounds)}]: {verdict} ({result.states:,} states, {took:.1f}s)"
                + ("" if ok else f"  UNEXPECTED: expected {expect or 'PASS'}"),
                flush=True,
            )
            for line in [result.violation or "", *result.stuck[:3]]:
                if line:
                    print(f"    {line}")
            if args.trace:
                for n, step in enumerate(result.trace, 1):
                    print(f"    {n:2}. {step}")
    print(f"{len(jobs)} searches, {time.monotonic() - started:.0f}s; unexpected: {unexpected}")
    return 1 if unexpected else 0


if __name__ == "__main__":
    raise SystemExit(main())
