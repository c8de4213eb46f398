"""The summary's verdicts: met or not by the median, and how many pairs fell on the other side."""

from __future__ import annotations

import pytest

from tests.benchmarks import summary


@pytest.mark.parametrize(
    ("pairs", "ratio", "verdict"),
    [
        ((0.78, 0.80, 0.81), 0.80, "met"),
        ((0.75, 0.67, 0.78, 0.80, 0.77), 0.77, "met (1 of 5 pairs under)"),
        ((0.76, 0.74, 0.74, 0.68, 0.70), 0.74, "UNMET (1 of 5 pairs meeting it)"),
        ((0.70,), 0.70, "UNMET"),
        ((0.75,), 0.75, "met"),  # the bound itself meets a floor
    ],
)
def test_a_rate_row_says_how_many_pairs_fell_under_its_floor(
    pairs: tuple[float, ...], ratio: float, verdict: str
) -> None:
    row = summary.Row("rate", "1 calls/s", "1 calls/s", pairs, 0.75)
    assert row.ratio == ratio  # the pairs' median
    assert row.verdict == verdict


def test_a_time_row_counts_the_pairs_over_its_ceiling() -> None:
    row = summary.Row("time", "1 s", "1 s", (0.80, 1.04, 1.15, 1.17), 1.1, time=True)
    assert row.verdict == "met (2 of 4 pairs over)"  # the median, 1.095, under the ceiling
    assert summary.Row("time", "1 s", "1 s", (1.2,), 1.1, time=True).verdict == "UNMET"


def test_a_row_without_a_target_has_no_verdict() -> None:
    assert summary.Row("rate", "1", "1", (0.1, 0.9), None).verdict == "-"


def test_the_table_prints_the_verdict_with_its_pairs() -> None:
    row = summary.Row("gated", "928 calls/s", "695 calls/s", (0.74, 0.77, 0.8), 0.75)
    (line,) = [text for text in summary.lines([row]) if text.startswith("gated")]
    assert line.endswith("0.77x  >= 0.75x  met (1 of 3 pairs under)")
