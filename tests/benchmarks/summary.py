"""The run's summary: one row per figure of the speed targets, each a ratio against plain Celery.

Each suite that measures ours against plain (``submit``, ``e2e``, ``beat``)
adds its rows here as it ends; ``python -m tests.benchmarks`` prints them
as one table after the last suite, so that ``tox -e bench`` ends with every
row of the targets, each taken from this run's own alternating rounds. A
row whose target is known says whether this run met it, and how many of
its pairs of rounds fell on the other side of the target: a ratio met with
two of five pairs under it is met by this run, not by every run (on this
two-core machine a pair's ratio moves by up to 0.1 either way).

Two kinds of ratio, as the targets are set:

* a **rate** (``.delay()`` calls, tasks through a worker): ours / plain, the
  higher the better, the target a floor ("at least 0.5x");
* a **time** (one beat dispatching a whole slot): ours / plain, the lower the
  better, the target a ceiling ("at most 2.5x").
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

#: Floors of the rate ratios, by (store, broker) of the submit suite.
SUBMIT_TARGETS = {
    ("redis", "redis"): 0.9,
    ("redis", "rabbitmq"): 0.75,
    ("postgres", "redis"): 0.5,
    ("mysql", "redis"): 0.5,
    ("django-postgres", "redis"): 0.5,
    ("sqlite", "redis"): 0.4,
}
#: Floors of the rate ratios of the e2e suite, by store.
E2E_TARGETS = {"redis": 0.85, "postgres": 0.65}
#: Floors of the atomic task's rate against the gated one's, e2e, by store: at least as fast.
ATOMIC_TARGETS = {"postgres": 1.0}
#: Ceilings of the time ratios of the beat suite, by store.
BEAT_TARGETS = {"redis": 1.1, "postgres": 2.5}

#: How a store is named in the table.
STORE_NAMES = {
    "redis": "Redis",
    "postgres": "PostgreSQL",
    "mysql": "MariaDB",
    "sqlite": "SQLite",
    "django-postgres": "django:// (PostgreSQL)",
}
BROKER_NAMES = {"redis": "Redis", "rabbitmq": "RabbitMQ (confirms)"}


@dataclass(frozen=True)
class Row:
    """One figure: what was measured, plain's and ours', each pair's ratio and the target."""

    what: str
    plain: str
    ours: str
    #: Each pair's ratio (ours / plain), in any order; the row's ratio is their median.
    pairs: tuple[float, ...]
    #: The target's bound, or ``None`` where none is set.
    target: float | None = None
    #: Whether the ratio is of times (lower is better) rather than rates.
    time: bool = False

    @property
    def ratio(self) -> float:
        return statistics.median(self.pairs)

    @property
    def verdict(self) -> str:
        """``met`` or ``UNMET``, then how many pairs fell on the other side of the target."""
        target = self.target
        if target is None:
            return "-"

        def meets(ratio: float) -> bool:
            return ratio <= target if self.time else ratio >= target

        met = meets(self.ratio)
        verdict = "met" if met else "UNMET"
        other = sum(1 for ratio in self.pairs if meets(ratio) != met)
        if other:
            side = ("over" if self.time else "under") if met else "meeting it"
            verdict += f" ({other} of {len(self.pairs)} pairs {side})"
        return verdict

    @property
    def bound(self) -> str:
        if self.target is None:
            return "-"
        return f"{'<=' if self.time else '>='} {self.target:.2f}x"


#: The rows of this run, in the order the suites measured them.
ROWS: list[Row] = []


def store_name(store: str) -> str:
    return STORE_NAMES.get(store, store)


def add(row: Row) -> None:
    ROWS.append(row)


@dataclass(frozen=True)
class Size:
    """One footprint figure: bytes per terminal job on a store, and its ceiling if set."""

    what: str
    per_job: float
    target: float | None = None

    @property
    def verdict(self) -> str:
        if self.target is None:
            return "-"
        return "met" if self.per_job <= self.target else "UNMET"


#: The footprint figures of this run (``--suite footprint``).
SIZES: list[Size] = []


def add_size(size: Size) -> None:
    SIZES.append(size)


def size_lines(sizes: list[Size] | None = None) -> list[str]:
    """The footprint part of the summary; nothing when the run measured none."""
    sizes = SIZES if sizes is None else sizes
    if not sizes:
        return []
    width = max(len(size.what) for size in sizes) + 2
    out = ["", f"{'store footprint, this run':<{width}}{'bytes/job':>12}{'target':>10}  verdict"]
    for size in sizes:
        bound = "-" if size.target is None else f"<= {size.target:,.0f}"
        out.append(f"{size.what:<{width}}{size.per_job:>12,.0f}{bound:>10}  {size.verdict}")
    return out


def lines(rows: list[Row] | None = None) -> list[str]:
    """The summary table of ``rows`` (the run's, by default); nothing when there is none."""
    rows = ROWS if rows is None else rows
    if not rows:
        return size_lines()
    width = max(len(row.what) for row in rows) + 2
    head = (
        f"{'ours against plain Celery, this run':<{width}}{'plain':>18}{'ours':>18}"
        f"{'ratio':>9}{'target':>10}  verdict"
    )
    out = ["", "summary (rates: ours/plain, higher is better; times: lower is better)", "", head]
    for row in rows:
        out.append(
            f"{row.what:<{width}}{row.plain:>18}{row.ours:>18}{row.ratio:>8.2f}x"
            f"{row.bound:>10}  {row.verdict}"
        )
    return out + size_lines()
