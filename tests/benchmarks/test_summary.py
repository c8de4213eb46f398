"""The summary's verdicts: met or not by the median, and how many pairs fell on the other side."""

from __future__ import annotations

import pytest

from tests.benchmarks import summary


@pytest.mark.parametrize(
    ("ratio", "pairs", "verdict"),
    [
        (0.80, (0.78, 0.80, 0.81), "met"),
        (0.77, (0.75, 0.67, 0.78, 0.80, 0.77), "met (1 of 5 pairs under)"),
        (0.74, (0.76, 0.74, 0.74, 0.68, 0.70), "UNMET (1 of 5 pairs meeting it)"),
        (0.70, (), "UNMET"),
        (0.75, (0.75,), "met"),  # the bound itself meets a floor
    ],
)
def test_a_rate_row_says_how_many_pairs_fell_under_its_floor(
    ratio: float, pairs: tuple[float, ...], verdict: str
) -> None:
    row = summary.Row("rate", "1 calls/s", "1 calls/s", ratio, 0.75, pairs=pairs)
    assert row.verdict == verdict


def test_a_time_row_counts_the_pairs_over_its_ceiling() -> None:
    row = summary.Row("time", "1 s", "1 s", 1.04, 1.1, time=True, pairs=(0.80, 1.04, 1.15, 1.17))
    assert row.verdict == "met (2 of 4 pairs over)"
    assert summary.Row("time", "1 s", "1 s", 1.2, 1.1, time=True, pairs=(1.2,)).verdict == "UNMET"


def test_a_row_without_a_target_has_no_verdict() -> None:
    assert summary.Row("rate", "1", "1", 0.5, None, pairs=(0.1, 0.9)).verdict == "-"


def test_the_table_prints_the_verdict_with_its_pairs() -> None:
    row = summary.Row("gated", "928 calls/s", "695 calls/s", 0.77, 0.75, pairs=(0.74, 0.77, 0.8))
    (line,) = [text for text in summary.lines([row]) if text.startswith("gated")]
    assert line.endswith(">= 0.75x  met (1 of 3 pairs under)")
