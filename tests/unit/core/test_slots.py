"""Nominal slots: intervals on a fixed grid, crontab with Celery's semantics, DST."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery.schedules import crontab, schedule, solar
from celery.utils.time import ffwd
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from celery_exactonce.core import slots
from celery_exactonce.core.exceptions import ConfigurationError

UTC = timezone.utc
BERLIN = ZoneInfo("Europe/Berlin")
NEW_YORK = ZoneInfo("America/New_York")
LORD_HOWE = ZoneInfo("Australia/Lord_Howe")


def _utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]


def _local_day(zone: ZoneInfo, year: int, month: int, day: int) -> tuple[datetime, datetime]:
    """The window (start, end] holding exactly the instants of one local day."""
    first = datetime(year, month, day, tzinfo=zone).astimezone(UTC)
    after = (datetime(year, month, day) + timedelta(days=1)).replace(tzinfo=zone)
    return first - timedelta(microseconds=1), after.astimezone(UTC) - timedelta(microseconds=1)


# -- intervals --------------------------------------------------------------------------


def test_interval_slots_are_anchored_at_the_origin_not_at_the_start() -> None:
    # Given two nodes whose windows start at different, jittered instants
    end = _utc(2026, 5, 1, 12, 0, 0)
    node_a = _utc(2026, 5, 1, 11, 58, 3, 141_592)
    node_b = _utc(2026, 5, 1, 11, 58, 3, 999_999)
    # When each computes the 30 s slots of the same entry
    for every in (30, 30.0, timedelta(seconds=30), schedule(run_every=timedelta(seconds=30))):
        a = slots.slots_between(every, node_a, end, tz=UTC)
        b = slots.slots_between(every, node_b, end, tz=UTC)
        # Then both get the same epoch-aligned slots, byte for byte
        assert a == b
        assert [s.isoformat() for s in a] == [s.isoformat() for s in b]
        assert a[0] == _utc(2026, 5, 1, 11, 58, 30)
        assert a[-1] == end
        assert all(s.microsecond == 0 and s.tzinfo is UTC for s in a)


def test_interval_window_is_half_open_and_pages_without_gaps() -> None:
    # Given a window starting exactly on a slot
    start, end = _utc(2026, 1, 1), _utc(2026, 1, 1, 0, 10)
    # When it is read in one go and in pages of 3
    whole = slots.slots_between(60, start, end, tz=UTC)
    paged: list[datetime] = []
    cursor = start
    while page := slots.slots_between(60, cursor, end, tz=UTC, limit=3):
        paged += page
        cursor = page[-1]
    # Then the start slot is excluded, the end slot included, and pages join exactly
    assert whole == [start + timedelta(minutes=k) for k in range(1, 11)]
    assert paged == whole


def test_sub_second_interval_and_custom_origin() -> None:
    # Given a 250 ms interval anchored at a custom origin
    origin = _utc(2026, 1, 1, 0, 0, 0, 100_000)
    # When slots are computed over half a second
    got = slots.slots_between(
        0.25, _utc(2026, 1, 1), _utc(2026, 1, 1, 0, 0, 0, 600_000), tz=UTC, origin=origin
    )
    # Then they sit on the origin's grid, microseconds included
    assert [s.microsecond for s in got] == [100_000, 350_000, 600_000]


@pytest.mark.parametrize("bad", [0, -5, timedelta(0), schedule(run_every=timedelta(seconds=-1))])
def test_non_positive_interval_is_a_configuration_error(bad: Any) -> None:
    # Given / When / Then
    with pytest.raises(ConfigurationError, match="'tick'"):
        slots.validate_schedule("tick", bad, UTC)


def test_latest_slot_for_an_interval() -> None:
    # Given an hourly interval; When asked at 10:59:59 and at 11:00 exactly
    # Then the latest slot is the hour at or before that instant
    assert slots.latest_slot(3600, _utc(2026, 2, 3, 10, 59, 59), tz=UTC) == _utc(2026, 2, 3, 10)
    assert slots.latest_slot(3600, _utc(2026, 2, 3, 11), tz=UTC) == _utc(2026, 2, 3, 11)


# -- crontab ----------------------------------------------------------------------------


def test_crontab_basic_cases_in_utc_and_berlin() -> None:
    # Given "every 15 minutes from 9 to 10" and "08:00 on weekdays"
    quarter = crontab(minute="*/15", hour="9-10")
    weekdays = crontab(minute=0, hour=8, day_of_week="mon-fri")
    # When computed for one UTC day and one Berlin week (CEST, +2)
    day = slots.slots_between(quarter, _utc(2026, 6, 1), _utc(2026, 6, 2), tz=UTC)
    week = slots.slots_between(weekdays, _utc(2026, 6, 6), _utc(2026, 6, 13), tz=BERLIN)
    # Then they are the UTC instants of those wall times
    assert day == [_utc(2026, 6, 1, h, m) for h in (9, 10) for m in (0, 15, 30, 45)]
    assert week == [_utc(2026, 6, d, 6) for d in (8, 9, 10, 11, 12)]  # Mon..Fri


def test_crontab_uses_its_own_zone_before_the_app_zone() -> None:
    # Given a crontab that carries its own zone (as django-celery-beat's does)
    own = crontab(minute=0, hour=9)
    own.tz = NEW_YORK
    # When the app zone passed in is Berlin
    got = slots.slots_between(own, _utc(2026, 6, 1), _utc(2026, 6, 2), tz=BERLIN)
    # Then 09:00 is New York time (EDT, -4)
    assert got == [_utc(2026, 6, 1, 13)]


def test_day_fields_are_anded_first_monday_only_for_a_whole_year() -> None:
    # Given Celery's AND of day_of_month and day_of_week
    first_monday = crontab(minute=0, hour=9, day_of_month="1-7", day_of_week=1)
    # When the slots of 2026 are computed in UTC
    got = slots.slots_between(first_monday, _utc(2026, 1, 1), _utc(2027, 1, 1), tz=UTC)
    # Then there is one per month, on its first Monday (croniter's OR would give ~80)
    assert len(got) == 12
    assert all(s.weekday() == 0 and s.day <= 7 and s.hour == 9 for s in got)
    assert [s.month for s in got] == list(range(1, 13))


def test_latest_slot_for_crontab_and_a_monthly_entry_twenty_days_later() -> None:
    # Given a monthly entry (1st at 03:00 Berlin) and a node asking on the 21st
    monthly = crontab(minute=0, hour=3, day_of_month=1)
    at = _utc(2026, 7, 21, 12)
    # When the latest slot is asked for
    latest = slots.latest_slot(monthly, at, tz=BERLIN)
    # Then it is the 1st of the month, 20 days earlier, and nothing lies between
    assert latest == _utc(2026, 7, 1, 1)
    assert slots.slots_between(monthly, latest, at, tz=BERLIN) == []
    # And a daily crontab's latest slot is today's when it has passed, else yesterday's
    daily = crontab(minute=30, hour=12)
    assert slots.latest_slot(daily, at, tz=UTC) == _utc(2026, 7, 20, 12, 30)
    assert slots.latest_slot(daily, _utc(2026, 7, 21, 12, 30), tz=UTC) == at + timedelta(minutes=30)


def test_windows_spanning_months_stay_cheap() -> None:
    # Given a minutely crontab and a window of a year (over 500k slots)
    every_minute = crontab()
    # When asked with a limit; Then only the first `limit` slots come back, fast
    got = slots.slots_between(every_minute, _utc(2026, 1, 1), _utc(2027, 1, 1), tz=BERLIN, limit=5)
    assert got == [_utc(2026, 1, 1, 0, m) for m in range(1, 6)]
    # And a monthly entry over a year is computed day by day, not minute by minute
    monthly = crontab(minute=0, hour=0, day_of_month=1)
    assert len(slots.slots_between(monthly, _utc(2026, 1, 1), _utc(2027, 1, 1), tz=UTC)) == 12


# -- DST --------------------------------------------------------------------------------

# (zone, gap day, fold day, fixed job inside the gap -> UTC slot, fixed job inside the
# fold -> UTC slot of its first occurrence). Lord Howe shifts by 30 minutes: the gap is
# 02:00-02:30 (+10:30 -> +11) on 4 Oct 2026, the fold 01:30-02:00 (+11 -> +10:30) on 5 Apr.
DST_CASES = [
    (
        BERLIN,
        (2026, 3, 29),
        (2026, 10, 25),
        (2, 30),
        _utc(2026, 3, 29, 1, 0),
        (2, 30),
        _utc(2026, 10, 25, 0, 30),
    ),
    (
        NEW_YORK,
        (2026, 3, 8),
        (2026, 11, 1),
        (2, 30),
        _utc(2026, 3, 8, 7, 0),
        (1, 30),
        _utc(2026, 11, 1, 5, 30),
    ),
    (
        LORD_HOWE,
        (2026, 10, 4),
        (2026, 4, 5),
        (2, 15),
        _utc(2026, 10, 3, 15, 30),
        (1, 45),
        _utc(2026, 4, 4, 14, 45),
    ),
]


@pytest.mark.parametrize("case", DST_CASES, ids=lambda c: str(c[0]))
def test_fixed_hour_job_fires_once_on_both_change_days(case: tuple[Any, ...]) -> None:
    zone, gap_day, fold_day, gap_time, gap_slot, fold_time, fold_slot = case
    # Given a daily job whose wall time falls inside the gap, and one inside the fold
    in_gap = crontab(hour=gap_time[0], minute=gap_time[1])
    in_fold = crontab(hour=fold_time[0], minute=fold_time[1])
    # When the slots of each change day are computed in the zone
    on_gap_day = slots.slots_between(in_gap, *_local_day(zone, *gap_day), tz=zone)
    on_fold_day = slots.slots_between(in_fold, *_local_day(zone, *fold_day), tz=zone)
    # Then each fires exactly once: after the gap, and at the fold's first occurrence
    assert on_gap_day == [gap_slot]
    assert on_fold_day == [fold_slot]
    assert fold_slot.astimezone(zone).fold == 0
    # And the same job fires once on the other change day as well
    assert len(slots.slots_between(in_gap, *_local_day(zone, *fold_day), tz=zone)) == 1
    assert len(slots.slots_between(in_fold, *_local_day(zone, *gap_day), tz=zone)) == 1


# Wildcard-hour counts per local day. Berlin/New York: a 23 h and a 25 h day, each
# hour's :15 and :45 happen once per real hour. Lord Howe: a 23.5 h and a 24.5 h day;
# only the half hour that is skipped or repeated changes the count, so :15 (inside the
# gap 02:00-02:30, outside the fold 01:30-02:00) gives 23 and 24, while :45 (outside
# the gap, inside the fold) gives 24 and 25.
WILDCARD_COUNTS = [
    (BERLIN, (2026, 3, 29), (2026, 10, 25), {15: (23, 25), 45: (23, 25)}),
    (NEW_YORK, (2026, 3, 8), (2026, 11, 1), {15: (23, 25), 45: (23, 25)}),
    (LORD_HOWE, (2026, 10, 4), (2026, 4, 5), {15: (23, 24), 45: (24, 25)}),
]


@pytest.mark.parametrize("case", WILDCARD_COUNTS, ids=lambda c: str(c[0]))
def test_wildcard_hour_job_fires_every_real_hour(case: tuple[Any, ...]) -> None:
    zone, gap_day, fold_day, counts = case
    for minute, (on_gap, on_fold) in counts.items():
        # Given a job at minute M of every hour
        job = crontab(minute=minute)
        # When the slots of both change days are computed
        gap_slots = slots.slots_between(job, *_local_day(zone, *gap_day), tz=zone)
        fold_slots = slots.slots_between(job, *_local_day(zone, *fold_day), tz=zone)
        # Then each real instant with that wall minute fires once, ascending, distinct
        assert (len(gap_slots), len(fold_slots)) == (on_gap, on_fold)
        for got in (gap_slots, fold_slots):
            assert got == sorted(set(got))
            assert all(s.astimezone(zone).minute == minute for s in got)


def test_gap_times_merge_into_the_slot_after_the_gap() -> None:
    # Given a fixed-hour job at 02:00, 02:30 and 03:00 (the first two inside the gap)
    job = crontab(hour="2,3", minute="0,30")
    # When the Berlin gap day is computed
    got = slots.slots_between(job, *_local_day(BERLIN, 2026, 3, 29), tz=BERLIN)
    # Then the gap times and 03:00 are one slot (01:00 UTC), then 03:30
    assert got == [_utc(2026, 3, 29, 1), _utc(2026, 3, 29, 1, 30)]


def test_latest_slot_across_the_fold_is_the_second_occurrence_for_wildcard_hours() -> None:
    # Given a wildcard-hour job and an instant just after the repeated 02:15 (01:15 UTC)
    at = _utc(2026, 10, 25, 1, 20)
    # When / Then its latest slot is that second occurrence
    assert slots.latest_slot(crontab(minute=15), at, tz=BERLIN) == _utc(2026, 10, 25, 1, 15)
    # And a fixed-hour job's latest slot is the first occurrence only
    assert slots.latest_slot(crontab(minute=15, hour=2), at, tz=BERLIN) == _utc(2026, 10, 25, 0, 15)


# -- errors -----------------------------------------------------------------------------


def test_unknown_schedule_type_names_the_entry() -> None:
    # Given something that is not a schedule; When / Then every entry point refuses it
    with pytest.raises(ConfigurationError, match=r"'nightly'.*str") as info:
        slots.slots_between(
            "0 3 * * *", _utc(2026, 1, 1), _utc(2026, 1, 2), tz=UTC, entry="nightly"
        )
    assert info.value.setting == "beat_schedule"
    with pytest.raises(ConfigurationError, match="'nightly'"):
        slots.latest_slot(object(), _utc(2026, 1, 1), tz=UTC, entry="nightly")
    with pytest.raises(ConfigurationError, match="'nightly'"):
        slots.validate_schedule("nightly", True, UTC)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"minute": "61"}, "minute"),
        ({"hour": "every hour"}, "hour"),
        ({"day_of_week": "funday"}, "day_of_week"),
        ({"minute": 1.5}, "minute"),
        ({"day_of_month": 31, "month_of_year": 2}, "day_of_month, month_of_year"),
        ({"minutes": 5}, "minutes"),
    ],
)
def test_invalid_crontab_field_names_the_entry_and_the_field(
    fields: dict[str, Any], named: str
) -> None:
    # Given / When / Then
    with pytest.raises(ConfigurationError, match=f"'report'.*{named}"):
        slots.parse_crontab("report", **fields)


def test_parse_crontab_returns_celery_crontab() -> None:
    assert slots.parse_crontab("ok", minute="*/5", hour=3) == crontab(minute="*/5", hour=3)


def test_crontab_that_never_fires_is_refused() -> None:
    # Given 29 February on a Monday (next in 2044), and an emptied field
    rare = crontab(minute=0, hour=0, day_of_month=29, month_of_year=2, day_of_week=1)
    empty = crontab(minute=0)
    empty.hour = set()
    # When / Then both are refused at validation, naming the entry
    with pytest.raises(ConfigurationError, match=r"'leap'.*no slot"):
        slots.validate_schedule("leap", rare, UTC, at=_utc(2026, 1, 1))
    with pytest.raises(ConfigurationError, match=r"'empty'.*hour"):
        slots.validate_schedule("empty", empty, UTC)
    # And 29 February on any weekday is fine (a slot within four years)
    slots.validate_schedule(
        "leap-any",
        crontab(minute=0, hour=0, day_of_month=29, month_of_year=2),
        UTC,
        at=_utc(2026, 1, 1),
    )


def test_naive_instants_are_refused() -> None:
    with pytest.raises(ValueError, match="aware"):
        slots.slots_between(60, datetime(2026, 1, 1), _utc(2026, 1, 2), tz=UTC)


# -- solar ------------------------------------------------------------------------------


def _fake_ephem(event_at: Callable[[datetime], datetime]) -> types.ModuleType:
    """A stand-in for ``ephem``: events at ``event_at(day)``, to the microsecond."""
    module = types.ModuleType("ephem")

    class Date(float):
        def __new__(cls, value: datetime) -> Date:
            obj = super().__new__(
                cls, value.timestamp() if value.tzinfo else value.replace(tzinfo=UTC).timestamp()
            )
            return obj

        def datetime(self) -> datetime:
            return datetime.fromtimestamp(float(self), UTC).replace(tzinfo=None)

    class Observer:
        def _next(self, _body: object, start: Date, **_kw: Any) -> Date:
            at = datetime.fromtimestamp(float(start), UTC)
            for offset in range(3):
                event = event_at(
                    (at + timedelta(days=offset)).replace(hour=0, minute=0, second=0, microsecond=0)
                )
                if event > at:
                    return Date(event)
            raise AssertionError("unreachable")

        next_rising = next_setting = next_transit = next_antitransit = _next

    module.Date = Date  # type: ignore[attr-defined]
    module.Observer = Observer  # type: ignore[attr-defined]
    module.Sun = object  # type: ignore[attr-defined]
    module.CircumpolarError = type("CircumpolarError", (Exception,), {})  # type: ignore[attr-defined]
    return module


def test_solar_slots_follow_celery_solar_and_are_start_independent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a solar schedule whose (fake) events fall at 06:0d:00.7 UTC on day d
    def event_at(day: datetime) -> datetime:
        return day.replace(hour=6, minute=day.day, microsecond=700_000)

    monkeypatch.setitem(sys.modules, "ephem", _fake_ephem(event_at))
    sunrise = solar("sunrise", 52.5, 13.4)
    # When two nodes compute the slots from different starts
    a = slots.slots_between(sunrise, _utc(2026, 6, 1, 1), _utc(2026, 6, 4), tz=UTC)
    b = slots.slots_between(sunrise, _utc(2026, 6, 1, 5, 59, 59, 3), _utc(2026, 6, 4), tz=UTC)
    # Then they agree, one per day, truncated to the second
    assert a == b == [_utc(2026, 6, d, 6, d) for d in (1, 2, 3)]
    assert slots.latest_slot(sunrise, _utc(2026, 6, 3, 7), tz=UTC) == _utc(2026, 6, 3, 6, 3)


def test_solar_with_real_ephem() -> None:
    ephem = pytest.importorskip("ephem", reason="ephem not installed: real solar slots untested")
    assert ephem is not None
    # Given sunrise in Berlin; When a week is computed; Then one slot a day, early morning
    got = slots.slots_between(
        solar("sunrise", 52.5, 13.4), _utc(2026, 6, 1), _utc(2026, 6, 8), tz=UTC
    )
    assert len(got) == 7
    assert all(2 <= s.hour <= 4 for s in got)


# -- property: Celery's own crontab -----------------------------------------------------

_FIELD = {
    "minute": (0, 59),
    "hour": (0, 23),
    "day_of_week": (0, 6),
    "day_of_month": (1, 31),
    "month_of_year": (1, 12),
}


@st.composite
def _cron_spec(draw: st.DrawFn, field: str) -> str:
    lo, hi = _FIELD[field]
    # Day and month fields are mostly "*": five random fields ANDed rarely fire at all.
    wild = 4 if field in {"day_of_week", "day_of_month", "month_of_year"} else 1
    kind = draw(st.sampled_from(["*"] * wild + ["value", "list", "range", "step"]))
    if kind == "*":
        return "*"
    if kind == "value":
        return str(draw(st.integers(lo, hi)))
    if kind == "list":
        values = draw(st.lists(st.integers(lo, hi), min_size=1, max_size=4, unique=True))
        return ",".join(map(str, values))
    a = draw(st.integers(lo, hi))
    b = draw(st.integers(a, hi))
    if kind == "range":
        return f"{a}-{b}"
    return f"{a}-{b}/{draw(st.integers(1, max(1, (hi - lo) // 2)))}"


def _celery_sequence(
    cron: crontab, zone: ZoneInfo, start: datetime, end: datetime, limit: int
) -> list[datetime]:
    """Celery's own answer: chain ``last_run_at + remaining_delta(last_run_at)``."""
    out: list[datetime] = []
    last = start.astimezone(zone)
    while len(out) < limit:
        last_run_at, delta, _now = cron.remaining_delta(last, tz=zone, ffwd=ffwd)
        nxt = (last_run_at + delta).astimezone(UTC)
        if nxt > end:
            break
        out.append(nxt)
        last = nxt.astimezone(zone)
    return out


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fields=st.fixed_dictionaries({field: _cron_spec(field) for field in _FIELD}),
    zone=st.sampled_from([ZoneInfo("UTC"), BERLIN]),
    # Berlin changes on 29 Mar and 25 Oct 2026: windows stay inside Apr 1 - Oct 21.
    start_minutes=st.integers(0, 182 * 24 * 60),
    days=st.integers(1, 20),
)
def test_slots_match_celery_crontab_away_from_dst(
    fields: dict[str, str], zone: ZoneInfo, start_minutes: int, days: int
) -> None:
    # Given a random crontab Celery accepts, and a window away from DST changes
    try:
        cron = crontab(nowfun=lambda: _utc(2026, 1, 1), **fields)
    except ValueError:
        assume(False)
        raise
    cron.tz = zone
    start = datetime(2026, 4, 1, tzinfo=zone).astimezone(UTC) + timedelta(minutes=start_minutes)
    end = start + timedelta(days=days)
    # When ours and Celery's are computed (first 150 slots at most)
    ours = slots.slots_between(cron, start, end, tz=UTC, limit=150)
    theirs = _celery_sequence(cron, zone, start, end, limit=150)
    # Then they are the same instants
    assert ours == theirs
