"""``celery_exactonce.schedules.cron``: cron expressions parsed by croniter, run as crontabs.

The property test holds our slot enumeration against croniter's own
iteration (``day_or=False``: Celery ANDs the day fields) away from DST
changes; the DST days are the scheduler's (tests/unit/beat/test_scheduler_calendar.py).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from celery.schedules import crontab
from croniter import croniter
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_exactonce.core import exceptions, slots
from celery_exactonce.schedules import at, bounded, cron
from tests.support.beat_cluster import Cluster, isolated, refused_at_start

UTC = timezone.utc
BERLIN = ZoneInfo("Europe/Berlin")


@pytest.fixture(autouse=True)
def _isolated() -> Iterator[None]:
    with isolated():
        yield


@pytest.mark.parametrize(
    ("expr", "fields"),
    [
        ("0 3 * * 1-5", {"minute": "0", "hour": "3", "day_of_week": "1-5"}),
        (
            "*/15 0-6/2 1,15 jan-mar mon-fri",
            {
                "minute": "*/15",
                "hour": "0-6/2",
                "day_of_month": "1,15",
                "month_of_year": "1-3",
                "day_of_week": "1-5",
            },
        ),
        ("0 0 * jul wed-thu", {"minute": 0, "hour": 0, "month_of_year": 7, "day_of_week": "3-4"}),
        ("0 0 * * 7", {"minute": 0, "hour": 0, "day_of_week": 0}),
        ("@daily", {"minute": 0, "hour": 0}),
        ("@hourly", {"minute": 0}),
        ("@weekly", {"minute": 0, "hour": 0, "day_of_week": 0}),
        ("@yearly", {"minute": 0, "hour": 0, "day_of_month": 1, "month_of_year": 1}),
        ("  30 2 * * *  ", {"minute": 30, "hour": 2}),
    ],
)
def test_an_expression_is_the_crontab_celery_would_build(
    expr: str, fields: dict[str, object]
) -> None:
    sched = cron(expr)
    assert isinstance(sched, crontab)
    expected = crontab(**fields)  # type: ignore[arg-type]
    for name in ("minute", "hour", "day_of_month", "month_of_year", "day_of_week"):
        assert getattr(sched, name) == getattr(expected, name), name


@pytest.mark.parametrize(
    ("expr", "field", "words"),
    [
        ("0 25 * * *", "hour", "out of range; hour is 0-23"),
        ("61 * * * *", "minute", "minute is 0-59"),
        ("x * * * *", "minute", "minute is 0-59"),
        ("*/0 * * * *", "minute", "minute is 0-59"),
        ("0 0 32 * *", "day_of_month", "day_of_month is 1-31"),
        ("0 0 * 13 *", "month_of_year", "month_of_year is 1-12"),
        ("0 0 * * 8", "day_of_week", "day_of_week is 0-6"),
        ("0 0 L * *", "day_of_month", "'L' (last day"),
        ("0 0 * * 5L", "day_of_week", "'L' (last day"),
        ("0 0 15W * *", "day_of_month", "'W' (nearest weekday)"),
        ("0 0 * * 5#2", "day_of_week", "'#' (nth weekday"),
        ("H * * * *", "minute", "'H' (hashed values)"),
    ],
)
def test_a_bad_field_is_named_with_the_expression_and_the_entry(
    expr: str, field: str, words: str
) -> None:
    sched = cron(expr)  # a bad expression is kept, not raised: beat names its entry
    assert sched.error is not None
    assert f"cron expression {expr!r}: field {field} " in str(sched.error)
    assert words in str(sched.error)
    with pytest.raises(exceptions.ConfigurationError) as caught:
        slots.validate_schedule("nightly", sched, UTC)
    assert str(caught.value).startswith(f"beat entry 'nightly': cron expression {expr!r}: ")
    assert f"field {field} " in str(caught.value)


def test_beat_refuses_to_start_on_a_bad_cron_naming_the_entry_and_the_field() -> None:
    """The building of the schedule raised nothing; beat's start-up check names both."""
    schedule = {
        "rollup": {"task": "plain.t", "schedule": cron("*/15 * * * *")},
        "nightly": {"task": "plain.t", "schedule": cron("0 3 * * 1-5x")},
    }
    with isolated(), refused_at_start() as refusal:
        Cluster(schedule, nodes=1)
    message = str(refusal[0])
    assert message.startswith("beat entry 'nightly': cron expression '0 3 * * 1-5x': ")
    assert "field day_of_week ('1-5x')" in message
    assert refusal[0].setting == "beat_schedule"


@pytest.mark.parametrize(
    ("expr", "words"),
    [
        ("0 0 0 * * *", "has 6 field(s); a cron expression has 5"),
        ("0 0 * *", "has 4 field(s)"),
        ("", "has 0 field(s)"),
        ("@reboot", "unknown alias '@reboot'"),
        ("0 0 30 2 *", "fields day_of_month and month_of_year: Invalid crontab: day_of_month"),
    ],
)
def test_a_malformed_expression_is_refused(expr: str, words: str) -> None:
    error = cron(expr).error
    assert error is not None
    assert str(error).startswith(f"cron expression {expr!r}: ")
    assert words in str(error)


def test_a_bad_zone_or_a_non_string_is_refused() -> None:
    assert "unknown time zone 'Mars/Olympus'" in str(cron("0 3 * * *", tz="Mars/Olympus").error)
    assert "must be a string, got int" in str(cron(5).error)  # type: ignore[arg-type]


def test_a_bad_expression_raises_its_error_when_used_and_keeps_it_through_a_pickle() -> None:
    sched = cron("0 25 * * *", tz="Europe/Berlin")
    now = datetime(2026, 1, 1, tzinfo=UTC)
    for use in (sched.is_due, sched.remaining_estimate):
        with pytest.raises(exceptions.ConfigurationError, match="field hour"):
            use(now)
    assert repr(sched) == "<cron: '0 25 * * *' (invalid)>"
    again = pickle.loads(pickle.dumps(sched))  # noqa: S301
    assert again == sched and str(again.error) == str(sched.error)
    assert cron("0 3 * * *", tz="Mars/Olympus") != cron("0 3 * * *")
    assert cron("0 3 * * *").error is None


def test_an_expression_that_never_fires_is_refused_naming_the_entry() -> None:
    sched = cron("0 0 29 2 1")  # 29 February on a Monday: 2044 is the next one
    with pytest.raises(exceptions.ConfigurationError, match="beat entry 'report': crontab"):
        slots.validate_schedule("report", sched, UTC, at=datetime(2026, 1, 1, tzinfo=UTC))


def test_it_pickles_compares_and_shows_its_expression() -> None:
    sched = cron("0 3 * * 1-5", tz="Europe/Berlin")
    # Stock beat shelves its schedules (its own file, not data from elsewhere)
    assert pickle.loads(pickle.dumps(sched)) == sched  # noqa: S301
    assert sched != cron("0 3 * * 1-5") != cron("0 4 * * 1-5")
    assert repr(sched) == "<cron: '0 3 * * 1-5' Europe/Berlin>"
    assert repr(cron("@daily")) == "<cron: '@daily'>"


def test_its_zone_moves_the_slots_and_follows_the_dst_rules() -> None:
    # 02:30 Berlin on the spring-forward day does not exist: it fires once, at 03:00 CEST
    sched = cron("30 2 * * *", tz="Europe/Berlin")
    window = (datetime(2026, 3, 27, 12, tzinfo=UTC), datetime(2026, 3, 30, 12, tzinfo=UTC))
    assert slots.slots_between(sched, *window, tz=UTC) == [
        datetime(2026, 3, 28, 1, 30, tzinfo=UTC),
        datetime(2026, 3, 29, 1, 0, tzinfo=UTC),
        datetime(2026, 3, 30, 0, 30, tzinfo=UTC),
    ]
    # Without a zone of its own, the app's zone is used
    assert slots.slots_between(cron("30 2 * * *"), *window, tz=BERLIN) == slots.slots_between(
        sched, *window, tz=UTC
    )


def test_stock_beat_reads_it_in_its_own_zone() -> None:
    # Celery's is_due, as django-celery-beat's zone-aware crontab gives it
    tzcrontab = pytest.importorskip("django_celery_beat.tzcrontab")
    now = datetime(2026, 6, 1, 0, 50, tzinfo=UTC)  # 02:50 in Berlin
    ours = cron("0 3 * * *", tz="Europe/Berlin", nowfun=lambda: now.astimezone(BERLIN))
    theirs = tzcrontab.TzAwareCrontab(minute=0, hour=3, tz=BERLIN)
    theirs.nowfun = lambda: now.astimezone(BERLIN)
    last = datetime(2026, 5, 31, 1, 0, tzinfo=UTC)
    assert ours.is_due(last) == theirs.is_due(last)
    assert ours.is_due(last).next == pytest.approx(600, abs=1)


def test_beat_runs_a_cron_entry_once_per_slot_on_several_nodes() -> None:
    start = datetime(2026, 3, 2, 7, 58, tzinfo=UTC)  # a Monday
    beat_schedule = {"report": {"task": "plain.t", "schedule": cron("*/5 8 * * 1-5")}}
    cluster = Cluster(beat_schedule, nodes=3, start=start, timezone="UTC")
    cluster.tick_all()
    cluster.run_until(start + timedelta(hours=1), step=60, rotate=True)
    assert cluster.fired("report") == [
        datetime(2026, 3, 2, 8, minute, tzinfo=UTC) for minute in range(0, 60, 5)
    ]


# -- against croniter ----------------------------------------------------------------------


def _field(values: list[int], low: int, high: int) -> st.SearchStrategy[str]:
    single = st.sampled_from(values).map(str)
    step = st.tuples(st.sampled_from(["*", f"{low}-{high}"]), st.integers(1, 10)).map(
        lambda pair: f"{pair[0]}/{pair[1]}"
    )
    span = st.tuples(st.sampled_from(values), st.sampled_from(values)).map(
        lambda pair: f"{min(pair)}-{max(pair)}"
    )
    many = st.lists(st.sampled_from(values), min_size=1, max_size=4, unique=True).map(
        lambda picked: ",".join(map(str, sorted(picked)))
    )
    return st.one_of(st.just("*"), single, step, span, many)


EXPRESSIONS = st.tuples(
    _field(list(range(60)), 0, 59),
    _field(list(range(24)), 0, 23),
    _field(list(range(1, 29)), 1, 31),
    _field(list(range(1, 13)), 1, 12),
    _field(list(range(7)), 0, 6),
).map(" ".join)


def _croniter_slots(expr: str, start: datetime, end: datetime, zone: ZoneInfo) -> list[datetime]:
    it = croniter(expr, start.astimezone(zone), day_or=False)
    found = []
    while (fire := it.get_next(datetime)) <= end:
        found.append(fire.astimezone(UTC))
    return found


@settings(max_examples=300, deadline=None)
@given(
    expr=EXPRESSIONS,
    zone=st.sampled_from([UTC, BERLIN, ZoneInfo("America/New_York"), ZoneInfo("Asia/Tokyo")]),
    # Windows inside May-August and December-January: no zone here changes its offset then
    start=st.one_of(
        st.datetimes(datetime(2001, 5, 1), datetime(2037, 8, 20)).filter(
            lambda d: 5 <= d.month <= 8
        ),
        st.datetimes(datetime(2001, 12, 1), datetime(2037, 1, 20)).filter(
            lambda d: d.month in (12, 1) and not (d.month == 1 and d.day > 20)
        ),
    ),
)
def test_slots_agree_with_croniter_away_from_dst_changes(
    expr: str, zone: ZoneInfo, start: datetime
) -> None:
    start = start.replace(tzinfo=UTC, microsecond=0)
    end = start + timedelta(days=10)
    ours = slots.slots_between(cron(expr, tz=zone), start, end, tz=UTC, limit=200)
    theirs = _croniter_slots(expr, start, end, zone)[:200]
    assert ours == theirs


# -- at and bounded ------------------------------------------------------------------------


def _utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]


def test_at_has_one_slot_and_stock_beat_runs_it_once() -> None:
    sched = at(_utc(2026, 5, 1, 12))
    assert slots.slots_between(sched, _utc(2026, 5, 1), _utc(2026, 5, 2), tz=UTC) == [
        _utc(2026, 5, 1, 12)
    ]
    assert slots.slots_between(sched, _utc(2026, 5, 1, 12), _utc(2026, 5, 2), tz=UTC) == []
    assert slots.latest_slot(sched, _utc(2026, 5, 1, 11), tz=UTC) is None
    assert slots.next_slot(sched, _utc(2026, 5, 1), tz=UTC) == _utc(2026, 5, 1, 12)
    before = at(_utc(2026, 5, 1, 12), nowfun=lambda: _utc(2026, 5, 1, 11, 59))
    after = at(_utc(2026, 5, 1, 12), nowfun=lambda: _utc(2026, 5, 1, 12, 1))
    assert before.is_due(None) == (False, 60.0)
    assert after.is_due(None).is_due is True
    assert after.is_due(_utc(2026, 5, 1, 12)).is_due is False  # it ran
    assert pickle.loads(pickle.dumps(sched)) == sched  # noqa: S301
    with pytest.raises(exceptions.ConfigurationError, match="timezone-aware"):
        at(datetime(2026, 5, 1))


def test_bounded_keeps_the_inner_slots_between_start_and_end_included() -> None:
    sched = bounded(timedelta(hours=1), start=_utc(2026, 5, 1, 3), end=_utc(2026, 5, 1, 6))
    assert slots.slots_between(sched, _utc(2026, 5, 1), _utc(2026, 5, 2), tz=UTC) == [
        _utc(2026, 5, 1, hour) for hour in (3, 4, 5, 6)
    ]
    assert slots.latest_slot(sched, _utc(2026, 5, 1, 9), tz=UTC) == _utc(2026, 5, 1, 6)
    assert slots.latest_slot(sched, _utc(2026, 5, 1, 2), tz=UTC) is None
    assert slots.next_slot(sched, _utc(2026, 5, 1, 6), tz=UTC) is None  # spent
    assert pickle.loads(pickle.dumps(sched)) == sched  # noqa: S301


def test_bounded_first_only_is_one_slot_every_node_agrees_on() -> None:
    # A one-off on a cron schedule: the first 03:00 at or after its start, on any window
    sched = bounded(cron("0 3 * * *"), start=_utc(2026, 5, 1, 3), first_only=True)
    windows = [(_utc(2026, 4, 30), _utc(2026, 5, 9)), (_utc(2026, 5, 1, 2), _utc(2026, 5, 1, 4))]
    for start, end in windows:
        assert slots.slots_between(sched, start, end, tz=UTC) == [_utc(2026, 5, 1, 3)]
    assert slots.slots_between(sched, _utc(2026, 5, 1, 3), _utc(2026, 5, 9), tz=UTC) == []
    assert slots.latest_slot(sched, _utc(2026, 5, 20), tz=UTC) == _utc(2026, 5, 1, 3)
    with pytest.raises(exceptions.ConfigurationError, match="needs a start"):
        bounded(cron("0 3 * * *"), first_only=True)


def test_bounded_anchored_counts_an_interval_from_its_start() -> None:
    """An anchored interval fires at ``start + k * interval``; before, ``bounded`` had no
    such flag and every interval counted from the UNIX epoch."""
    start = _utc(2026, 5, 1, 9, 30)
    sched = bounded(timedelta(hours=3), start=start, end=_utc(2026, 5, 2), anchored=True)
    assert slots.slots_between(sched, _utc(2026, 5, 1), _utc(2026, 5, 3), tz=UTC) == [
        _utc(2026, 5, 1, hour, 30) for hour in (9, 12, 15, 18, 21)
    ]
    assert slots.latest_slot(sched, _utc(2026, 5, 1, 14), tz=UTC) == _utc(2026, 5, 1, 12, 30)
    assert slots.next_slot(sched, _utc(2026, 5, 1, 14), tz=UTC) == _utc(2026, 5, 1, 15, 30)
    once = bounded(timedelta(hours=3), start=start, first_only=True, anchored=True)
    assert slots.slots_between(once, _utc(2026, 5, 1), _utc(2026, 5, 3), tz=UTC) == [start]
    assert pickle.loads(pickle.dumps(sched)) == sched  # noqa: S301
    assert sched != bounded(timedelta(hours=3), start=start, end=_utc(2026, 5, 2))
    with pytest.raises(exceptions.ConfigurationError, match="anchored=True"):
        bounded(timedelta(hours=3), anchored=True)


def test_a_bounded_schedule_is_checked_from_its_start() -> None:
    # A cron that has no slot for years is refused, naming the entry, through its bounds too
    with pytest.raises(exceptions.ConfigurationError, match="beat entry 'leap'"):
        slots.validate_schedule(
            "leap", bounded(cron("0 0 29 2 1"), start=_utc(2026, 1, 1)), UTC, at=_utc(2026, 1, 1)
        )
