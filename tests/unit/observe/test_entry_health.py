"""Each beat entry's health (:mod:`celery_exactonce.observe.entry_health`), on the memory store.

The occurrences are written as beat writes them (the id of
:func:`~celery_exactonce.beat.entries.occurrence_id`, the create advancing the
entry's watermark), on a frozen store clock the tests step.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from celery.beat import ScheduleEntry
from celery.schedules import crontab, schedule

from celery_exactonce.beat.entries import occurrence_id
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.observe import prometheus
from celery_exactonce.observe.entry_health import EntryHealth, EntryHealthReader
from celery_exactonce.observe.gauges import BeatGauges, StoreGauges
from celery_exactonce.stores import InMemoryStore
from celery_exactonce.testing.clock import FrozenClock
from tests.support.helpers import move

START = datetime(2026, 11, 30, 12, 0, 0, tzinfo=timezone.utc)


def entry(name: str, task: str, every: Any) -> ScheduleEntry:
    return ScheduleEntry(name=name, task=task, schedule=every)


def world(**entries: ScheduleEntry) -> tuple[InMemoryStore, FrozenClock, EntryHealthReader]:
    clock = FrozenClock(START)
    store = InMemoryStore("health", clock=clock)
    reader = EntryHealthReader(store, lambda: dict(entries), tz=timezone.utc, periods=2)
    return store, clock, reader


def fire(store: InMemoryStore, name: str, at: datetime, end: State | None) -> None:
    """An occurrence of ``name`` at ``at`` claimed (its watermark moves), taken to ``end``."""
    new = NewJob(
        JobRef.occurrence(occurrence_id(store.namespace, name, at), name),
        "tasks.t",
        State.SCHEDULED,
        node="n",
        entry=name,
        fire_time=at,
    )
    job = store.create(new).job
    assert job is not None
    if end is None:
        return
    job = move(store, job, State.DISPATCHED)
    if end is not State.PUBLISHED:
        job = move(store, job, State.RUNNING)
    move(store, job, end)


def by_entry(found: list[EntryHealth]) -> dict[str, EntryHealth]:
    return {h.entry: h for h in found}


def test_an_entry_shows_its_last_claim_last_success_next_slot_and_period() -> None:
    store, clock, reader = world(
        ok=entry("ok", "tasks.ok", schedule(timedelta(minutes=1))),
        daily=entry("daily", "tasks.daily", crontab(minute=30, hour=6)),
    )
    fire(store, "ok", START, State.SUCCEEDED)
    clock.advance(10)
    health = by_entry(reader.read())
    ok = health["ok"]
    assert (ok.task, ok.last_claimed, ok.last_success) == ("tasks.ok", START, START)
    assert ok.next_slot == START + timedelta(minutes=1) and ok.period == 60.0
    assert not ok.overdue
    daily = health["daily"]
    assert daily.last_claimed is None and daily.last_success is None
    assert daily.next_slot == datetime(2026, 12, 1, 6, 30, tzinfo=timezone.utc)
    assert daily.period == 86400.0


def test_an_entry_whose_slots_keep_failing_turns_overdue_after_periods_plus_one() -> None:
    store, clock, reader = world(bad=entry("bad", "tasks.bad", schedule(timedelta(minutes=1))))
    fire(store, "bad", START, State.SUCCEEDED)
    reader.read()
    for minute in (1, 2):  # the two slots after the success fail
        clock.set(START + timedelta(minutes=minute, seconds=5))
        fire(store, "bad", START + timedelta(minutes=minute), State.FAILED)
        assert not by_entry(reader.read())["bad"].overdue  # each still had its period
    clock.set(START + timedelta(minutes=3, seconds=1))  # slot 2's period is over too
    bad = by_entry(reader.read())["bad"]
    assert (
        bad.overdue
        and bad.last_success == START
        and bad.last_claimed == START + timedelta(minutes=2)
    )
    # ... until a slot succeeds again
    fire(store, "bad", START + timedelta(minutes=3), State.SUCCEEDED)
    assert not by_entry(reader.read())["bad"].overdue


def test_a_running_occurrence_is_read_again_until_it_ends() -> None:
    store, clock, reader = world(slow=entry("slow", "tasks.slow", schedule(timedelta(hours=1))))
    new = NewJob(
        JobRef.occurrence(occurrence_id(store.namespace, "slow", START), "slow"),
        "tasks.slow",
        State.SCHEDULED,
        node="n",
        entry="slow",
        fire_time=START,
    )
    job = move(store, move(store, store.create(new).job, State.DISPATCHED), State.RUNNING)  # type: ignore[arg-type]
    assert by_entry(reader.read())["slow"].last_success is None
    move(store, job, State.SUCCEEDED)
    clock.advance(1)
    assert by_entry(reader.read())["slow"].last_success == START


def test_an_ungated_entry_succeeds_when_its_message_is_published() -> None:
    store, _clock, reader = world(plain=entry("plain", "tasks.p", schedule(timedelta(seconds=30))))
    fire(store, "plain", START, State.PUBLISHED)
    assert by_entry(reader.read())["plain"].last_success == START


def test_an_entry_never_succeeding_is_overdue_from_when_beat_first_saw_it() -> None:
    _store, clock, reader = world(new=entry("new", "tasks.n", schedule(timedelta(seconds=10))))
    assert not by_entry(reader.read())["new"].overdue
    clock.advance(29)
    assert not by_entry(reader.read())["new"].overdue
    clock.advance(2)  # 31 s > (2 + 1) x 10 s without a success
    assert by_entry(reader.read())["new"].overdue


def test_an_entry_removed_from_the_schedule_is_forgotten() -> None:
    schedule_now = {"a": entry("a", "tasks.a", schedule(timedelta(seconds=10)))}
    clock = FrozenClock(START)
    store = InMemoryStore("health", clock=clock)
    reader = EntryHealthReader(store, lambda: dict(schedule_now), tz=timezone.utc, periods=2)
    fire(store, "a", START, State.SUCCEEDED)
    assert [h.entry for h in reader.read()] == ["a"]
    schedule_now.clear()
    assert reader.read() == [] and not reader._succeeded  # nothing kept of it


def test_beat_serves_each_entrys_gauges_labelled_with_entry_and_task() -> None:
    store, _clock, reader = world(ok=entry("ok", "tasks.ok", schedule(timedelta(minutes=1))))
    fire(store, "ok", START, State.SUCCEEDED)
    collector = prometheus.BeatCollector(BeatGauges("n"), StoreGauges(store, health=reader))
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in collector.collect()
        for s in family.samples
    }
    labels = (("entry", "ok"), ("task", "tasks.ok"))
    assert values[("exactonce_entry_last_claimed_timestamp_seconds", labels)] == START.timestamp()
    assert values[("exactonce_entry_last_success_timestamp_seconds", labels)] == START.timestamp()
    next_slot = (START + timedelta(minutes=1)).timestamp()
    assert values[("exactonce_entry_next_slot_timestamp_seconds", labels)] == next_slot
    assert values[("exactonce_entry_period_seconds", labels)] == 60.0
    assert values[("exactonce_entry_overdue", labels)] == 0.0


def test_an_entrys_next_slot_is_computed_again_once_it_passes_or_the_schedule_changes() -> None:
    schedule_now = {"a": entry("a", "tasks.a", schedule(timedelta(minutes=1)))}
    clock = FrozenClock(START + timedelta(seconds=1))
    store = InMemoryStore("health", clock=clock)
    reader = EntryHealthReader(store, lambda: dict(schedule_now), tz=timezone.utc, periods=2)
    assert by_entry(reader.read())["a"].next_slot == START + timedelta(minutes=1)
    clock.advance(58)  # still before it
    assert by_entry(reader.read())["a"].next_slot == START + timedelta(minutes=1)
    clock.advance(2)  # past it
    assert by_entry(reader.read())["a"].next_slot == START + timedelta(minutes=2)
    # a re-timed entry (a new schedule) is computed at once, whatever was kept
    schedule_now["a"] = entry("a", "tasks.a", schedule(timedelta(seconds=10)))
    health = by_entry(reader.read())["a"]
    assert health.period == 10.0 and health.next_slot == START + timedelta(minutes=1, seconds=10)
