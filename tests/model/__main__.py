"""Run the model from the command line: ``python -m tests.model [--variant NAME] [--trace]``."""

from __future__ import annotations

import argparse
import time

from .checker import Bounds
from .scope import VARIANTS, differences, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.model", description=__doc__)
    parser.add_argument(
        "--variant",
        action="append",
        choices=sorted(VARIANTS),
        help="a variant to search (repeatable; default: all)",
    )
    parser.add_argument("--trace", action="store_true", help="print each counterexample")
    parser.add_argument("--faults", type=int, default=Bounds.faults)
    parser.add_argument("--passes", type=int, default=Bounds.passes)
    args = parser.parse_args(argv)
    bounds = Bounds(faults=args.faults, passes=args.passes)
    unexpected = 0
    for problem in differences():
        print(f"table: {problem}")
        unexpected += 1
    for name in args.variant or list(VARIANTS):
        variant, started = VARIANTS[name], time.monotonic()
        result = run(name, bounds)
        took = time.monotonic() - started
        found = result.violation.split(":")[0] if result.violation else None
        verdict = "PASS" if found is None else f"FAIL {found} in {len(result.trace)} steps"
        expected = found == variant.breaks
        unexpected += not expected
        print(
            f"{name}: {verdict} ({result.states} states, {took:.1f}s)"
            + ("" if expected else f"  UNEXPECTED: expected {variant.breaks or 'PASS'}")
        )
        if result.violation:
            print(f"    {result.violation}")
        if args.trace:
            for n, step in enumerate(result.trace, 1):
                print(f"    {n:2}. {step}")
    return 1 if unexpected else 0


if __name__ == "__main__":
    raise SystemExit(main())
