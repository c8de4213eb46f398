"""The planner: which due slots of an entry a tick claims, which it skips, and why (pure)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from celery_exactonce.beat.entries import EntryPolicy
from celery_exactonce.beat.planner import Plan, plan, select
from celery_exactonce.beat.skips import SkipTally
from celery_exactonce.config import ExactOnceConfig

NOW = datetime(2026, 6, 1, 12, 0, 0, tzinfo=timezone.utc)
CONFIG = ExactOnceConfig(store_url="memory://", window_lookback=300.0, catchup_limit=3)
EVERY_MINUTE = timedelta(minutes=1)


def minutes_ago(*minutes: int) -> list[datetime]:
    return [NOW - timedelta(minutes=m) for m in minutes]


def policy(catchup: str = "latest", max_lateness: float | None = None) -> EntryPolicy:
    return EntryPolicy(catchup, max_lateness, None)  # type: ignore[arg-type]


def plan_of(decided: datetime | None, **kw: object) -> Plan:
    args: dict[str, object] = {
        "tz": timezone.utc,
        "config": CONFIG,
        "decided": decided,
        "now": NOW,
        "floor": None,
        "floor_reason": "unprovable",
    }
    args.update(kw)
    pol = args.pop("policy", policy())
    return plan("e", EVERY_MINUTE, pol, **args)  # type: ignore[arg-type]


def test_a_node_that_decided_the_last_slot_plans_only_the_next_one() -> None:
    result = plan_of(NOW - timedelta(minutes=1))
    assert result.due == [NOW]
    assert result.claim == [NOW]
    assert result.skipped == []
    assert result.decided_to() == NOW


def test_nothing_due_leaves_the_entry_decided_where_it_stood() -> None:
    decided = NOW
    result = plan_of(decided, now=NOW + timedelta(seconds=20))
    assert result.due == [] and result.claim == []
    assert result.decided_to() == decided


def test_latest_claims_the_newest_missed_slot_and_skips_the_rest_as_catchup() -> None:
    result = plan_of(NOW - timedelta(minutes=4))
    assert result.claim == [NOW]
    assert result.skipped == [("catchup", minutes_ago(3, 2, 1))]


def test_all_claims_at_most_catchup_limit_of_the_newest() -> None:
    result = plan_of(NOW - timedelta(minutes=4, seconds=30), policy=policy("all"))
    assert result.claim == minutes_ago(2, 1, 0)
    assert result.skipped == [("catchup", minutes_ago(4, 3))]


def test_none_claims_only_what_fell_due_since_the_last_tick() -> None:
    claim, skipped = select(policy("none"), minutes_ago(3, 2, 0), NOW, CONFIG)
    assert claim == [NOW]
    assert skipped == minutes_ago(3, 2)


def test_max_lateness_skips_slots_too_late_whatever_the_catchup() -> None:
    claim, skipped = select(policy("all", max_lateness=90), minutes_ago(3, 2, 1, 0), NOW, CONFIG)
    assert claim == minutes_ago(1, 0)
    assert skipped == minutes_ago(3, 2)


def test_slots_that_left_the_window_are_skipped_and_the_entry_starts_at_the_window() -> None:
    decided = NOW - timedelta(minutes=8)
    result = plan_of(decided, policy=policy("all"))
    window, fallen = result.skipped[0]
    assert window == "window"
    assert fallen == minutes_ago(7, 6, 5)
    assert result.start == NOW - timedelta(seconds=CONFIG.window_lookback)
    assert result.due == minutes_ago(4, 3, 2, 1, 0)


def test_slots_at_or_below_the_floor_are_skipped_with_the_floor_reason() -> None:
    result = plan_of(
        NOW - timedelta(minutes=3),
        policy=policy("all"),
        floor=NOW - timedelta(minutes=1),
        floor_reason="store_loss",
    )
    assert result.skipped == [("store_loss", minutes_ago(2, 1))]
    assert result.claim == [NOW]


def test_a_failed_claim_leaves_the_entry_decided_up_to_the_slot_before_it() -> None:
    result = Plan("e", start=NOW - timedelta(minutes=3), due=minutes_ago(2, 1, 0))
    result.failed.append(NOW - timedelta(minutes=1))
    assert result.decided_to() == NOW - timedelta(minutes=2)
    result.failed.append(NOW - timedelta(minutes=2))
    assert result.decided_to() == NOW - timedelta(minutes=3)


def test_the_tally_reports_once_per_reason_and_counts_every_slot() -> None:
    tally = SkipTally()
    tally.add("a", minutes_ago(3, 2), "catchup")
    tally.add("b", minutes_ago(1), "catchup")
    tally.add("a", minutes_ago(9), "window")
    reports = list(tally.reports())
    assert [(r.where, r.total, r.entries, r.entry) for r in reports] == [
        ("catchup", 3, 2, "a"),
        ("window", 1, 1, "a"),
    ]
    assert "3 slot(s) skipped (the catch-up policy): a from" in reports[0].message
    assert reports[0].message.endswith("and 1 more entries")
    assert list(tally.reports()) == []
