"""Plain Celery against ours in alternating rounds of one run, and the table that shows them.

A suite times a *round* of the same work twice, once through plain Celery and
once through celery-exactonce, and alternates: plain, ours, plain, ours... so
that load drift on a shared machine hits both alike. Its figures are the
medians of the rounds' rates, and the ratio is the median of the per-pair
ratios of the rates (ours / plain: 1.00x is as fast, 0.50x half the rate, the
unit the project's targets are set in, "at least 0.9x plain"). Each pair's
ratio is printed too, so a noisy run shows itself.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Rounds:
    """Seconds of each round of ``work`` items, plain and ours, pair by pair."""

    work: int
    plain: tuple[float, ...]
    ours: tuple[float, ...]
    #: Rounds of a third arm, where a suite has one: plain Celery's work plus only what the
    #: physics of ours cannot avoid (the submit suite: one store write before each call).
    floor: tuple[float, ...] = ()

    @property
    def plain_rate(self) -> float:
        """Items per second through plain Celery (the median of the rounds)."""
        return statistics.median(self.work / s for s in self.plain)

    @property
    def ours_rate(self) -> float:
        """Items per second through celery-exactonce (the median of the rounds)."""
        return statistics.median(self.work / s for s in self.ours)

    @property
    def ratios(self) -> list[float]:
        """Each pair's rate ours / plain (its time plain / ours), in the order the pairs ran."""
        return [plain / ours for plain, ours in zip(self.plain, self.ours, strict=True)]

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    @property
    def floor_ratio(self) -> float | None:
        """The median of each pair's rate floor / plain (``None``: no floor rounds)."""
        if not self.floor:
            return None
        return statistics.median(p / f for p, f in zip(self.plain, self.floor, strict=True))


def alternate(
    rounds: int,
    work: int,
    plain: Callable[[], float],
    ours: Callable[[], float],
    floor: Callable[[], float] | None = None,
) -> Rounds:
    """``rounds`` pairs of ``plain()`` then ``ours()``, each returning the seconds of its round;
    with ``floor``, each pair has its round between the two."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    plains: list[float] = []
    ourses: list[float] = []
    floors: list[float] = []
    for _ in range(rounds):
        plains.append(plain())
        if floor is not None:
            floors.append(floor())
        ourses.append(ours())
    return Rounds(work, tuple(plains), tuple(ourses), tuple(floors))


def table(label: str, unit: str, rows: Sequence[tuple[str, Rounds]]) -> list[str]:
    """The lines of a table: one row per ``(name, rounds)``, rates in ``unit`` per second."""
    head = (
        f"{label:<34}{'plain ' + unit + '/s':>16}{'ours ' + unit + '/s':>16}"
        f"{'ours/plain':>12}   each pair (rate ours/plain)"
    )
    lines = [head]
    for name, figures in rows:
        each = " ".join(f"{r:.2f}x" for r in figures.ratios)
        lines.append(
            f"{name:<34}{figures.plain_rate:>16,.0f}{figures.ours_rate:>16,.0f}"
            f"{figures.ratio:>11.2f}x   {each}"
        )
    return lines
