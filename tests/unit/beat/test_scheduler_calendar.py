"""ExactOnceScheduler against the calendar, at the scheduler level, on a frozen clock.

Several beat nodes on one InMemoryStore (:mod:`tests.support.beat_cluster`) run
through DST change days, Celery's ANDed day fields, downtime under each
catch-up policy, record expiry and schedule changes. What they dispatch is
compared with fire instants computed here with ``zoneinfo`` alone, never with
:mod:`celery_exactonce.core.slots`.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterator
from datetime import date, datetime, time, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery.schedules import crontab, schedule

from celery_exactonce.beat.scheduler import ExactOnceScheduler
from celery_exactonce.core import exceptions
from celery_exactonce.core.jobs import CreateResult
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.observe import metrics
from tests.support.beat_cluster import START, Cluster, every, isolated

UTC = timezone.utc
BERLIN = ZoneInfo("Europe/Berlin")
NEW_YORK = ZoneInfo("America/New_York")
LORD_HOWE = ZoneInfo("Australia/Lord_Howe")
TOKYO = ZoneInfo("Asia/Tokyo")
MINUTE = timedelta(minutes=1)


@pytest.fixture(autouse=True)
def _isolated() -> Iterator[None]:
    with isolated():
        yield


def _utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]


def entry(sched: Any, **exactonce: Any) -> dict[str, Any]:
    """A beat entry of a plain task on ``sched``, with per-entry overrides ``exactonce``."""
    return {"task": "plain.t", "schedule": sched, "options": {"exactonce": exactonce}}


# -- expected fire instants, from zoneinfo alone ----------------------------------------


def local_midnight(zone: ZoneInfo, day: date) -> datetime:
    """The UTC instant a clock in ``zone`` shows 00:00 on ``day`` (no zone here skips it)."""
    return datetime.combine(day, time(0), tzinfo=zone).astimezone(UTC)


def wall_clock(zone: ZoneInfo, start: datetime, end: datetime) -> list[tuple[datetime, datetime]]:
    """Every whole UTC minute in ``(start, end]``, with what a wall clock in ``zone`` shows."""
    instant = start.replace(second=0, microsecond=0) + MINUTE
    shown = []
    while instant <= end:
        shown.append((instant, instant.astimezone(zone)))
        instant += MINUTE
    return shown


def fixed_hour_fires(
    zone: ZoneInfo, hour: int, minute: int, start: datetime, end: datetime
) -> list[datetime]:
    """A daily H:M job: per local date, the first instant the wall clock shows H:M or later.

    That is H:M itself on an ordinary day, the end of the gap when H:M falls in
    a spring-forward gap, and its first occurrence when it falls in a fold.
    """
    first: dict[date, datetime] = {}
    for instant, wall in wall_clock(zone, start - timedelta(days=1), end):
        if wall.time() >= time(hour, minute):
            first.setdefault(wall.date(), instant)
    return sorted(t for t in first.values() if start < t <= end)


def wildcard_hour_fires(
    zone: ZoneInfo, minute: int, start: datetime, end: datetime
) -> list[datetime]:
    """An every-hour job at :M: every real instant in ``(start, end]`` whose wall clock shows :M."""
    return [instant for instant, wall in wall_clock(zone, start, end) if wall.minute == minute]


def after(fires: list[datetime], instant: datetime) -> list[datetime]:
    return [fire for fire in fires if fire > instant]


# -- DST ---------------------------------------------------------------------------------

# zone: (gap day, fold day, daily job inside the gap, daily job inside the fold). Lord Howe
# moves by 30 minutes: the gap is 02:00-02:30 (4 Oct 2026), the fold 01:30-02:00 (5 Apr).
ZONES = {
    "Europe/Berlin": (BERLIN, date(2026, 3, 29), date(2026, 10, 25), (2, 30), (2, 30)),
    "America/New_York": (NEW_YORK, date(2026, 3, 8), date(2026, 11, 1), (2, 30), (1, 30)),
    "Australia/Lord_Howe": (LORD_HOWE, date(2026, 10, 4), date(2026, 4, 5), (2, 15), (1, 45)),
}

# Worked out by hand, to check the brute force above as well: (zone, change day) ->
# (the UTC fire of the daily job inside the gap/fold that local day, how many times a
# :00 job and a :30 job fire that local day).
ANCHORS = {
    ("Europe/Berlin", "gap"): (_utc(2026, 3, 29, 1, 0), 23, 23),
    ("Europe/Berlin", "fold"): (_utc(2026, 10, 25, 0, 30), 25, 25),
    ("America/New_York", "gap"): (_utc(2026, 3, 8, 7, 0), 23, 23),
    ("America/New_York", "fold"): (_utc(2026, 11, 1, 5, 30), 25, 25),
    ("Australia/Lord_Howe", "gap"): (_utc(2026, 10, 3, 15, 30), 23, 24),
    ("Australia/Lord_Howe", "fold"): (_utc(2026, 4, 4, 14, 45), 24, 25),
}

#: Beat step of the DST runs: every slot here is on a 15-minute grid, so each one is
#: claimed by the first tick at or after it, within the default 5-minute window.
DST_STEP = 300


@pytest.mark.parametrize("change", ["gap", "fold"])
@pytest.mark.parametrize("zone_name", list(ZONES))
def test_dst_change_days_at_the_scheduler_level(zone_name: str, change: str) -> None:
    zone, gap_day, fold_day, gap_job, fold_job = ZONES[zone_name]
    day = gap_day if change == "gap" else fold_day
    # Given three nodes of an app in the zone, with daily jobs whose wall time falls in
    # the gap and in the fold, wildcard-hour jobs at :00/:15/:30/:45 and an hourly interval
    beat_schedule = {
        "in_gap": entry(crontab(hour=gap_job[0], minute=gap_job[1])),
        "in_fold": entry(crontab(hour=fold_job[0], minute=fold_job[1])),
        **{f"hourly_{m:02}": entry(crontab(minute=m)) for m in (0, 15, 30, 45)},
        "interval_1h": entry(timedelta(hours=1)),
    }
    start = local_midnight(zone, day) - timedelta(seconds=DST_STEP / 2)
    end = local_midnight(zone, day + timedelta(days=1)) + timedelta(seconds=DST_STEP / 2)
    cluster = Cluster(beat_schedule, nodes=3, start=start, timezone=zone_name)
    # When they tick every 5 minutes through the local change day, a different node first
    cluster.tick_all()
    cluster.run_until(end, step=DST_STEP, rotate=True)
    # Then every entry fired at exactly the instants zoneinfo gives, each once
    expected = {
        "in_gap": fixed_hour_fires(zone, *gap_job, start, end),
        "in_fold": fixed_hour_fires(zone, *fold_job, start, end),
        **{f"hourly_{m:02}": wildcard_hour_fires(zone, m, start, end) for m in (0, 15, 30, 45)},
        "interval_1h": [t for t, _ in wall_clock(UTC, start, end) if t.minute == 0],
    }
    assert {name: cluster.fired(name) for name in beat_schedule} == expected
    assert len(cluster.broker.sent) == sum(map(len, expected.values()))
    # And no slot was claimed before it fell due on the store's clock, or a step late
    for job in cluster.broker.sent:
        assert job.fire_time is not None
        assert job.fire_time <= job.created_at < job.fire_time + timedelta(seconds=DST_STEP)
    # And, on the local change day: each daily job once, the one inside the gap/fold at
    # the hand-worked instant, and the wildcard-hour jobs once per real hour
    anchor, count_00, count_30 = ANCHORS[(zone_name, change)]
    first, last = local_midnight(zone, day), local_midnight(zone, day + timedelta(days=1))

    def on_day(name: str) -> list[datetime]:
        return [fire for fire in cluster.fired(name) if first <= fire < last]

    assert on_day("in_gap" if change == "gap" else "in_fold") == [anchor]
    assert len(on_day("in_gap")) == len(on_day("in_fold")) == 1
    assert (len(on_day("hourly_00")), len(on_day("hourly_30"))) == (count_00, count_30)


@pytest.mark.parametrize("day", [date(2026, 3, 29), date(2026, 10, 25)], ids=["gap", "fold"])
def test_an_entry_with_its_own_zone_follows_it_not_the_app_zone(day: date) -> None:
    # Celery's crontab takes no zone; its `tz` (the app's) can be set per instance, which is
    # what django-celery-beat's TzAwareCrontab does. `nowfun` does not choose the zone.
    tzcrontab = pytest.importorskip("django_celery_beat.tzcrontab")
    # Given an app in Tokyo (no DST) with Berlin entries, and a crontab whose nowfun is in
    # New York
    beat_schedule = {
        "berlin_0230": entry(tzcrontab.TzAwareCrontab(minute=30, hour=2, tz=BERLIN)),
        "berlin_hourly": entry(tzcrontab.TzAwareCrontab(minute=30, tz=BERLIN)),
        "nowfun_ny": entry(crontab(minute=30, hour=2, nowfun=lambda: datetime.now(NEW_YORK))),
    }
    start = local_midnight(BERLIN, day) - timedelta(seconds=DST_STEP / 2)
    end = local_midnight(BERLIN, day + timedelta(days=1)) + timedelta(seconds=DST_STEP / 2)
    cluster = Cluster(beat_schedule, nodes=2, start=start, timezone="Asia/Tokyo")
    # When they tick through Berlin's change day
    cluster.tick_all()
    cluster.run_until(end, step=DST_STEP, rotate=True)
    # Then the Berlin entries follow Berlin's DST rules, the other one Tokyo's wall clock
    assert cluster.fired("berlin_0230") == fixed_hour_fires(BERLIN, 2, 30, start, end)
    assert cluster.fired("berlin_0230") == [
        _utc(2026, 3, 29, 1) if day.month == 3 else _utc(2026, 10, 25, 0, 30)
    ]
    assert cluster.fired("berlin_hourly") == wildcard_hour_fires(BERLIN, 30, start, end)
    assert cluster.fired("nowfun_ny") == fixed_hour_fires(TOKYO, 2, 30, start, end) != []


# -- Celery's day fields -----------------------------------------------------------------


def test_day_fields_are_anded_first_monday_of_the_month_only() -> None:
    # Given three nodes of an app in New York and a job at 09:00 on days 1-7 that are Mondays
    beat_schedule = {
        "first_monday": entry(crontab(minute=0, hour=9, day_of_month="1-7", day_of_week=1)),
    }
    start, end = _utc(2026, 5, 31), _utc(2026, 10, 1)
    cluster = Cluster(
        beat_schedule, start=start, timezone="America/New_York", exactonce_window_lookback=7200
    )
    # When they tick every hour from 31 May to 1 October 2026
    cluster.tick_all()
    cluster.run_until(end, step=3600, rotate=True)
    # Then it fired on the first Monday of June to September only (1 June is a Monday, and
    # so is 7 September); croniter's OR of the day fields would fire on 42 days
    days = [start.date() + timedelta(days=n) for n in range((end - start).days)]
    expected = [
        datetime.combine(d, time(9), tzinfo=NEW_YORK).astimezone(UTC)
        for d in days
        if d.weekday() == 0 and d.day <= 7
    ]
    assert expected == [
        _utc(2026, 6, 1, 13),
        _utc(2026, 7, 6, 13),
        _utc(2026, 8, 3, 13),
        _utc(2026, 9, 7, 13),
    ]
    assert cluster.fired("first_monday") == expected


# -- catch-up after downtime -------------------------------------------------------------

#: Entries every 10 minutes, one per policy (catchup_limit is 5 in these tests).
CATCHUP_POLICIES: dict[str, dict[str, Any]] = {
    "latest": {},
    "all": {"catchup": "all"},
    "none": {"catchup": "none"},
    "latest_late30": {"max_lateness": 1800},
    "all_late30": {"catchup": "all", "max_lateness": 1800},
    "latest_late5": {"max_lateness": 300},
}

# Minutes after T0 of the slots each entry dispatches when every node was down from T0
# for 2 h (12 missed slots, T0+10 .. T0+120) and then ticks on the last slot (+0 s) or
# 400 s after it. "all" keeps the *newest* catchup_limit slots (as "latest" keeps the
# newest one); "none" only a slot that fell due since the previous tick (within
# tick_interval).
CATCHUP_EXPECTED = {
    0: {
        "latest": [120],
        "all": [80, 90, 100, 110, 120],
        "none": [120],
        "latest_late30": [120],
        "all_late30": [90, 100, 110, 120],
        "latest_late5": [120],
    },
    400: {
        "latest": [120],
        "all": [80, 90, 100, 110, 120],
        "none": [],
        "latest_late30": [120],
        "all_late30": [100, 110, 120],
        "latest_late5": [],
    },
}


def _skips_by_entry(records: list[logging.LogRecord], where: str = "catchup") -> Counter[str]:
    """Skipped slots per entry, from the per-entry ``slot_skipped_entry`` debug records.

    The number is read from the message ("<entry>: <n> slot(s) from ..."): the record's
    ``extra`` names the entry and the reason but does not carry the count.
    """
    skipped: Counter[str] = Counter()
    for record in records:
        if getattr(record, "action", None) != "slot_skipped_entry":
            continue
        if record.where == where:  # type: ignore[attr-defined]
            match = re.match(rf"{re.escape(record.entry)}: (\d+) slot", record.getMessage())  # type: ignore[attr-defined]
            assert match, record.getMessage()
            skipped[record.entry] += int(match.group(1))  # type: ignore[attr-defined]
    return skipped


@pytest.mark.parametrize("late", [0, 400])
def test_catch_up_policies_after_two_hours_down(
    late: int, caplog: pytest.LogCaptureFixture
) -> None:
    # Given three nodes done up to T0, a 3 h window that covers the downtime, catchup_limit 5
    nodes = 3
    cluster = Cluster(
        {name: every(600, exactonce=policy) for name, policy in CATCHUP_POLICIES.items()},
        nodes=nodes,
        exactonce_window_lookback=3 * 3600,
        exactonce_catchup_limit=5,
    )
    cluster.tick_all()
    t0, before = cluster.clock.now(), len(cluster.broker.sent)
    metrics.COUNTERS.reset()
    caplog.set_level(logging.DEBUG, logger="celery_exactonce")
    caplog.clear()
    # When every node is cut off for 2 hours (12 slots of each entry missed), then ticks;
    # the same scheduler instances resume (a suspended host, a partition): for restarted
    # ones see the restart tests below
    cluster.clock.advance(2 * 3600 + late)
    cluster.tick_all()
    # Then each entry dispatched exactly the slots its policy keeps, each once
    got = {
        name: [(f - t0) // MINUTE for f in after(cluster.fired(name), t0)]
        for name in CATCHUP_POLICIES
    }
    assert got == CATCHUP_EXPECTED[late]
    assert len(cluster.broker.sent) - before == sum(map(len, got.values()))
    # And every missed slot not run was counted as skipped: by the node that claimed the
    # newest (the others start from its watermark), or by each node when none was claimed
    not_run = {name: 12 - len(runs) for name, runs in got.items()}
    counted = _skips_by_entry(caplog.records)
    assert set(counted) == {n for n, k in not_run.items() if k}
    for name, k in not_run.items():
        assert counted[name] == (k if got[name] else nodes * k), name
    assert metrics.COUNTERS.get("slot_skipped", where="catchup") == sum(counted.values())


def test_slots_older_than_the_window_are_never_dispatched() -> None:
    # Given three nodes done up to T0 with the default 5-minute window and minutely entries
    cluster = Cluster(
        {
            "latest": every(60),
            "all": every(60, exactonce={"catchup": "all"}),
            "none": every(60, exactonce={"catchup": "none"}),
        }
    )
    cluster.tick_all()
    t0 = cluster.clock.now()
    # When every node is cut off for 2 hours (120 slots missed), then ticks on a slot
    cluster.clock.advance(2 * 3600)
    cluster.tick_all()
    # Then only slots inside the window (T0+116 .. T0+120 min) may run, whatever the policy:
    # the 115 older ones are never claimed (counted where=window: see below)
    window = [t0 + k * MINUTE for k in range(116, 121)]
    assert after(cluster.fired("all"), t0) == window
    assert after(cluster.fired("latest"), t0) == after(cluster.fired("none"), t0) == window[-1:]
    # And nothing older is claimed later either
    cluster.run(600, step=60)
    assert min(after(cluster.fired("all"), t0)) == window[0]


def test_slots_missed_beyond_the_window_are_counted() -> None:
    # Given one node done up to T0 with the default window and minutely entries
    cluster = Cluster(
        {
            "latest": every(60),
            "all": every(60, exactonce={"catchup": "all"}),
            "none": every(60, exactonce={"catchup": "none"}),
        },
        nodes=1,
    )
    cluster.tick_all()
    t0 = cluster.clock.now()
    metrics.COUNTERS.reset()
    # When it is down for 2 hours, then ticks on a slot
    cluster.clock.advance(2 * 3600)
    cluster.tick_all()
    # Then every one of the 3 x 120 missed slots that did not run is counted as skipped
    ran = sum(len(after(cluster.fired(name), t0)) for name in ("latest", "all", "none"))
    assert ran == 5 + 1 + 1
    # (115 of each left the window unclaimed: where=window; the rest where=catchup)
    assert metrics.COUNTERS.get("slot_skipped") == 3 * 120 - ran
    assert metrics.COUNTERS.get("slot_skipped", where="window") == 3 * 115


@pytest.mark.parametrize("catchup", ["latest", "all"])
def test_each_slot_lost_to_a_store_outage_is_counted_once(catchup: str) -> None:
    # Given one node done up to T0 with a minutely entry and the default 5-minute window
    cluster = Cluster({"e": every(60, exactonce={"catchup": catchup})}, nodes=1)
    cluster.tick_all()
    t0 = cluster.clock.now()
    metrics.COUNTERS.reset()
    real_create_many = cluster.store.create_many
    outage = [True]

    def create_many(news: list[NewJob], **kwargs: Any) -> list[CreateResult]:
        if outage[0]:
            raise exceptions.StoreUnavailable("store down")
        return real_create_many(news, **kwargs)

    cluster.store.create_many = create_many  # type: ignore[method-assign]
    # When every claim fails for 20 minutes, then the store recovers
    cluster.run(20 * 60, step=60)
    outage[0] = False
    cluster.run(60, step=60)
    # Then each of the 21 slots since T0 either ran or was counted as skipped, once
    ran = after(cluster.fired("e"), t0)
    assert ran and metrics.COUNTERS.get("fail_closed", phase="claim_write") == 20
    assert metrics.COUNTERS.get("slot_skipped") == 21 - len(ran)


def test_a_restarted_node_catches_up_what_it_missed_not_what_already_ran() -> None:
    # Given one node that ran a per-second entry with catchup="all" (all defaults: window
    # 300 s, catchup_limit 100)
    cluster = Cluster({"all": every(1, exactonce={"catchup": "all"})}, nodes=1)
    cluster.run(400)
    stopped = cluster.clock.now()
    # When it is down for 30 s and restarts (a new scheduler on the same store)
    cluster.clock.advance(30)
    cluster.nodes = [ExactOnceScheduler(cluster.app)]
    cluster.tick_all()
    # Then the 30 slots it missed (fewer than catchup_limit) are dispatched
    assert after(cluster.fired("all"), stopped) == [
        stopped + timedelta(seconds=k) for k in range(1, 31)
    ]


def test_a_restarted_node_counts_only_the_slots_it_missed() -> None:
    # Given one node that ran a 10-second entry (catchup "latest", window 300 s)
    cluster = Cluster({"latest": every(10)}, nodes=1)
    cluster.run(400, step=10)
    stopped = cluster.clock.now()
    metrics.COUNTERS.reset()
    # When it is down for 30 s and restarts
    cluster.clock.advance(30)
    cluster.nodes = [ExactOnceScheduler(cluster.app)]
    cluster.tick_all()
    # Then it ran the newest of the 3 missed slots and counted the other 2, not 29
    assert after(cluster.fired("latest"), stopped) == [stopped + timedelta(seconds=30)]
    assert metrics.COUNTERS.get("slot_skipped", where="catchup") == 2


def test_a_slot_skipped_by_catch_up_is_never_dispatched_later() -> None:
    # Given one node done up to T0, entries every 10 min, catchup="all", limit 5, window 4000 s
    cluster = Cluster(
        {"all": every(600, exactonce={"catchup": "all"})},
        nodes=1,
        exactonce_window_lookback=4000,
        exactonce_catchup_limit=5,
    )
    cluster.tick_all()
    t0 = cluster.clock.now()
    # When it is down 2 h: it catches up the 5 newest slots of its window, skips T0+60/70 min
    cluster.clock.advance(2 * 3600)
    cluster.tick_all()
    caught_up = after(cluster.fired("all"), t0)
    assert [(f - t0) // MINUTE for f in caught_up] == [80, 90, 100, 110, 120]
    # And it dies at once, and restarts 50 minutes later
    cluster.clock.advance(3000)
    cluster.nodes = [ExactOnceScheduler(cluster.app)]
    cluster.tick_all()
    # Then the two slots it counted as skipped are not dispatched now
    skipped = {t0 + 60 * MINUTE, t0 + 70 * MINUTE}
    assert not skipped & set(cluster.fired("all"))


# -- retention and the watermark ---------------------------------------------------------


@pytest.mark.parametrize("catchup", ["latest", "all"])
def test_a_monthly_slot_is_not_rerun_after_its_record_expired(catchup: str) -> None:
    # Given a monthly entry, a one-day retention (config and store), and a node that
    # dispatches the 1 July 00:00 slot
    day1 = _utc(2026, 7, 1)
    cluster = Cluster(
        {"monthly": entry(crontab(0, 0, day_of_month=1), catchup=catchup)},
        nodes=1,
        start=day1 - MINUTE,
        store_retention=86_400,
        exactonce_retention=86_400,
    )
    cluster.tick_all()
    cluster.run(600, step=60)
    assert cluster.fired("monthly") == [day1]
    ref = cluster.broker.sent[0].ref
    assert cluster.store.get(ref).state is State.PUBLISHED  # type: ignore[union-attr]
    # When the node is down until the 20th, and the expired record is purged
    cluster.clock.set(_utc(2026, 7, 20, 12))
    cluster.store.purge_expired(100)  # (a reconcile pass may have purged it already)
    assert cluster.store.get(ref) is None
    assert cluster.store.watermark("monthly") == day1
    # Then a restarted node (a new scheduler, same store) runs nothing
    cluster.nodes = [ExactOnceScheduler(cluster.app)]
    cluster.tick_all()
    cluster.run(3600, step=60)
    assert cluster.fired("monthly") == [day1]
    # And even with the day-1 slot back inside a node's window (the store clock stepped
    # back: the only way a slot can be re-derived once its record expired, since retention
    # >= window_lookback + tick_interval + max_skew), the watermark refuses the claim
    cluster.clock.set(day1 + MINUTE)
    cluster.nodes = [ExactOnceScheduler(cluster.app)]
    cluster.tick_all()
    assert cluster.fired("monthly") == [day1]
    assert cluster.store.get(ref) is None
    # And the next month fires as usual, once
    cluster.clock.set(_utc(2026, 8, 1) - MINUTE)
    cluster.nodes = [ExactOnceScheduler(cluster.app), ExactOnceScheduler(cluster.app)]
    cluster.run(600, step=60)
    assert cluster.fired("monthly") == [day1, _utc(2026, 8, 1)]


# -- schedule shapes and changes ---------------------------------------------------------


def test_nodes_with_different_tick_intervals_dispatch_each_slot_once_on_time() -> None:
    # Given nodes of three apps, same schedule, tick_interval 1 s, 7 s and 15 s, each running
    # Celery's beat loop (sleep for what tick() returned)
    beat_schedule = {
        "every_s": every(1),
        "every_5s_none": every(5, exactonce={"catchup": "none"}),
        "cron": entry(crontab(minute="*")),
    }
    cluster = Cluster(beat_schedule, nodes=1, exactonce_tick_interval=1)
    cluster.add_node(beat_schedule, exactonce_tick_interval=7)
    cluster.add_node(beat_schedule, exactonce_tick_interval=15)
    start = cluster.clock.now()
    # When they run for 3 minutes, then without the 1 s node for 2 more
    cluster.run_as_beat(180)
    del cluster.nodes[0]
    ticks = cluster.run_as_beat(120)
    end = cluster.clock.now()
    # Then every slot fired once, claimed the very instant it fell due (a node sleeps until
    # its next slot, never a whole tick_interval past it), by the slower nodes too
    grid = [start + timedelta(seconds=s) for s in range(301)]
    assert cluster.fired("every_s") == grid
    assert cluster.fired("every_5s_none") == [t for t in grid if t.second % 5 == 0]
    assert cluster.fired("cron") == [t for t in grid if t.second == 0]
    assert all(job.created_at == job.fire_time for job in cluster.broker.sent)
    assert end == start + timedelta(seconds=300) and ticks <= 2 * 121


def test_an_entry_removed_from_the_schedule_stops_firing_during_a_rolling_deploy() -> None:
    # Given two nodes with entries "kept" and "gone"
    cluster = Cluster({"kept": every(10), "gone": every(10)}, nodes=2)
    start = cluster.clock.now()
    cluster.tick_all()
    cluster.run(60)
    # When one node is redeployed without "gone", then the other one
    cluster.nodes[0] = ExactOnceScheduler(cluster.new_app({"kept": every(10)}))
    cluster.run(60)
    cluster.nodes[1] = ExactOnceScheduler(cluster.new_app({"kept": every(10)}))
    cluster.run(60)
    # Then "gone" fired once per slot while any node still had it, and never after
    slots = [start + timedelta(seconds=s) for s in range(0, 181, 10)]
    assert cluster.fired("gone") == slots[:13]  # up to +120 s, when the last old node went
    assert cluster.fired("kept") == slots
    # And an entry removed from a running node's schedule stops at once
    for node in cluster.nodes:
        del node.schedule["kept"]
    cluster.run(60)
    assert cluster.fired("kept") == slots


def test_an_entry_added_at_run_time_fires() -> None:
    # Given two running nodes
    cluster = Cluster({"kept": every(10)}, nodes=2)
    cluster.run(30)
    added_at = cluster.clock.now()
    # When an entry is added to each through Celery's Scheduler API
    for node in cluster.nodes:
        node.add(name="added", task="plain.t", schedule=timedelta(seconds=10))
    cluster.run(60)
    # Then it fires on its slots from then on (the slot at added_at is due: the newest of
    # its window, as for any entry at start), once each
    assert cluster.fired("added") == [added_at + timedelta(seconds=s) for s in range(0, 61, 10)]


def test_an_interval_given_as_seconds_fires_on_the_same_fixed_grid() -> None:
    # Given 30 s intervals spelled four ways (Celery turns a number into a schedule), and
    # nodes starting 7 s after a grid point
    beat_schedule = {
        "int": {"task": "plain.t", "schedule": 30},
        "float": {"task": "plain.t", "schedule": 30.0},
        "timedelta": {"task": "plain.t", "schedule": timedelta(seconds=30)},
        "relative": {"task": "plain.t", "schedule": schedule(timedelta(seconds=30), relative=True)},
    }
    cluster = Cluster(beat_schedule, start=START + timedelta(seconds=7))
    # When three nodes tick every second for 3 minutes
    cluster.tick_all()
    cluster.run(180)
    # Then all four fire on the epoch-anchored 30 s grid (START is on it), each slot once
    grid = [START + timedelta(seconds=s) for s in range(0, 181, 30)]
    for name in beat_schedule:
        assert cluster.fired(name) == grid, name
