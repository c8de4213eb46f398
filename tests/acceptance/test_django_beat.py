"""Real ``celery beat -S exactonce-django`` processes on django-celery-beat's rows.

Two beats and a worker over one Django database (PostgreSQL; SQLite too under
``-m slow``), 20 ``PeriodicTask`` rows (intervals, crontabs, clocked one-offs,
interval one-offs) for a minute, while the test creates, edits, disables,
renames and deletes rows through the ORM and SIGKILLs one beat and starts
another. The ledger the task bodies write must show every occurrence run once,
each one-off once, and each row's ``total_run_count`` must be its runs in the
ledger. On SQLite the default run has the rows' logic with three scheduler
nodes and edits (tests/django_tests/test_scheduler.py, both databases) and two
real beats on the Django example's SQLite database (test_django_example.py).

The control: two stock django-celery-beat ``DatabaseScheduler`` beats on the
same kind of rows run the occurrences twice, which is what the test above
would see if the guarantee failed.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Mapping, Set
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from celery_exactonce.core import slots
from tests.acceptance import beats as b
from tests.acceptance.django_project import DjangoBeat, DjangoDatabase
from tests.acceptance.harness import (
    Deployment,
    Ledger,
    poll,
)

UTC = timezone.utc
RUN_SECONDS = 60
#: Store-time seconds into the run at which the test changes rows, or a beat.
CREATE_AT, DISABLE_AT, KILL_AT, DELETE_AT = 10, 20, 25, 40
#: The one-off rows and when each fires, seconds after the start: clocked (k) and
#: interval rows whose start_time is that instant (o); k01 is due at the SIGKILL.
ONE_OFFS = {"k01": 25, "k02": 45, "o01": 15, "o02": 35}
#: As in test_beat.py: slots this close to the start or the stop are outside the window.
START_MARGIN, END_MARGIN = 3, 4


def start_beat(
    deployment: Deployment, database: DjangoDatabase, scheduler: str, **conf: Any
) -> DjangoBeat:
    env = {
        **deployment.env,
        **database.env(),
        "EXACTONCE_ACC_BEAT_EVERY": "0",  # no settings entries: the rows only
        "EXACTONCE_ACC_EXTRA_CONF": json.dumps({"exactonce_reconcile_on": "beat", **conf}),
    }
    beat = DjangoBeat(env, deployment.tmp_path, f"beat-{len(deployment.beats) + 1}", scheduler)
    deployment.beats.append(beat)
    return beat.start()


# -- rows ------------------------------------------------------------------------------------


def interval(seconds: int) -> Any:
    from django_celery_beat.models import IntervalSchedule

    return IntervalSchedule.objects.get_or_create(every=seconds, period="seconds")[0]


def add(name: str, task: str = "gated_beat", **fields: Any) -> Any:
    from django_celery_beat.models import PeriodicTask

    if not {"interval", "crontab", "clocked"} & set(fields):
        fields["interval"] = interval(2)
    return PeriodicTask.objects.create(name=name, task=task, args=json.dumps([name]), **fields)


def rows() -> dict[str, Any]:
    from django_celery_beat.models import PeriodicTask

    return {row.name: row for row in PeriodicTask.objects.all()}


def runs_by_row(ledger: Ledger, names: Mapping[str, int]) -> Counter[int]:
    """Runs in the ledger per row (by pk), under every name the row had."""
    found: Counter[int] = Counter()
    for row in ledger.rows(phase="run"):
        name = row.meta.get("row")
        if name in names:
            found[names[name]] += 1
    return found


# -- the run ---------------------------------------------------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis",))
@pytest.mark.parametrize(
    "django_database", ["postgres", pytest.param("sqlite", marks=pytest.mark.slow)], indirect=True
)
def test_two_beats_run_edited_rows_once_through_a_sigkill(
    deployment: Deployment, ledger: Ledger, gate: None, django_database: DjangoDatabase
) -> None:
    from django_celery_beat.models import PeriodicTask

    # Given 20 rows: intervals, crontabs, clocked one-offs and interval one-offs
    deployment.start_worker(concurrency=4)
    deployment.store()
    now = b.store_now(deployment)
    start = now + timedelta(seconds=10)  # the beats are up by then
    names = given_twenty_rows(start)
    # ... and two beats on them
    beats = [start_beat(deployment, django_database, "exactonce-django") for _ in range(2)]
    for beat in beats:
        beat.wait_ready()
    b.run_until(deployment, start, beats)
    floor = b.claim_floor(deployment)

    # When rows are created, edited, disabled, renamed and deleted while they run,
    # and one beat is SIGKILLed and another started
    b.run_until(deployment, start + timedelta(seconds=CREATE_AT), beats)
    for name in ("n01", "n02"):
        names[name] = add(name, interval=interval(3)).pk
    # (The edits save the fields they change: a whole-row save(), the admin's, writes
    # total_run_count back as it read it, and loses a run counted in between.)
    edited = PeriodicTask.objects.get(name="i01")
    edited.interval = interval(4)
    edited.save(update_fields=["interval"])
    b.run_until(deployment, start + timedelta(seconds=DISABLE_AT), beats)
    disabled = PeriodicTask.objects.get(name="i02")
    disabled.enabled = False
    disabled.save(update_fields=["enabled", "last_run_at"])  # save() empties last_run_at
    renamed = PeriodicTask.objects.get(name="i03")
    renamed.name = "i03-renamed"
    renamed.save(update_fields=["name"])
    names["i03-renamed"] = renamed.pk
    b.run_until(deployment, start + timedelta(seconds=KILL_AT), beats)
    beats[0].kill()
    kills = {beats[0].node: b.store_now(deployment)}
    beats[0] = start_beat(deployment, django_database, "exactonce-django")
    beats[0].wait_ready()
    b.run_until(deployment, start + timedelta(seconds=DELETE_AT), beats)
    PeriodicTask.objects.get(name="i04").delete()
    b.run_until(deployment, start + timedelta(seconds=RUN_SECONDS), beats)
    enabled = {name: row.enabled for name, row in rows().items()}
    stopped = disable_every_row(deployment, beats)
    for beat in beats:
        beat.kill()

    # Then no occurrence ran twice, anywhere in the run
    b.assert_no_duplicates(ledger)
    # ... the untouched every-2-seconds rows ran every slot of the window (a claim the
    # SIGKILL or the stop cut off before its publish, the documented window, aside)
    window = (
        max(start, floor) + timedelta(seconds=START_MARGIN),
        stopped - timedelta(seconds=END_MARGIN),
    )
    steady = [f"i{i:02}" for i in range(5, 13)]
    expected = {
        (name, fire)
        for name in steady
        for fire in slots.slots_between(timedelta(seconds=2), *window, tz=UTC)
    }
    orphans = b.unpublished_claims(deployment, expected - set(ledger.occurrences()), kills)
    b.wait_executed(ledger, expected - orphans)
    b.assert_each_ran_once(deployment, ledger, expected - orphans)
    # ... each one-off ran once and is disabled, and the edited rows followed their edits
    one_offs = {(name, start + timedelta(seconds=at)) for name, at in ONE_OFFS.items()}
    cut_off = b.unpublished_claims(deployment, one_offs - set(ledger.occurrences()), kills)
    assert_one_offs_ran_once(ledger, start, enabled, cut_off)
    assert_rows_followed_the_edits(ledger, names, start)
    # ... and every row counts what ran of it
    assert_each_row_counts_its_runs(deployment, ledger, names, kills, one_offs)


def given_twenty_rows(start: datetime) -> dict[str, int]:
    """12 rows every 2 s, 4 every minute, 2 clocked and 2 interval one-offs; pk by name."""
    from django_celery_beat.models import ClockedSchedule, CrontabSchedule

    minutely = CrontabSchedule.objects.create(minute="*", timezone=ZoneInfo("UTC"))
    for i in range(1, 13):
        add(f"i{i:02}", task="plain_beat" if i % 4 == 0 else "gated_beat")
    for i in range(1, 5):
        add(f"c{i:02}", crontab=minutely)
    for name, at in ONE_OFFS.items():
        when = start + timedelta(seconds=at)
        if name.startswith("k"):
            add(name, clocked=ClockedSchedule.objects.create(clocked_time=when), one_off=True)
        else:
            add(name, interval=interval(5), one_off=True, start_time=when)
    names = {name: row.pk for name, row in rows().items()}
    assert len(names) == 20
    return names


def disable_every_row(deployment: Deployment, beats: list[DjangoBeat]) -> datetime:
    """Disable every row and wait until each beat has read them again and runs none.

    A beat killed after that is between ticks with nothing to claim: each slot
    it claimed was counted in its row in the same tick, so the rows' counts can
    be held to the ledger exactly (a kill mid-tick may leave a published slot
    that no node counted). Returns the store time of the disabling: the end of
    the run.
    """
    from django_celery_beat.models import PeriodicTask, PeriodicTasks

    stopped = b.store_now(deployment)
    PeriodicTask.objects.update(enabled=False)
    PeriodicTasks.update_changed()

    def idle(beat: DjangoBeat) -> bool:
        return any(event.get("rows") == 0 for event in beat.events("schedule_reloaded"))

    poll(lambda: all(idle(beat) for beat in beats), timeout=30, interval=0.2)
    return stopped


def assert_one_offs_ran_once(
    ledger: Ledger, start: datetime, enabled: Mapping[str, bool], cut_off: set[b.Occurrence]
) -> None:
    """Each one-off ran once and beat disabled it (``enabled``: the rows before the stop).

    ``cut_off``: one-offs the SIGKILLed beat claimed and never published (k01 is
    due at the kill), the reconciler's to settle: they may not have run, never twice.
    """
    occurrences = ledger.occurrences()
    for name, at in ONE_OFFS.items():
        fires = [fire for entry, fire in occurrences if entry == name]
        if (name, start + timedelta(seconds=at)) in cut_off:
            assert len(fires) <= 1, name
            continue
        assert fires == [start + timedelta(seconds=at)], name
        assert enabled[name] is False, name


def assert_rows_followed_the_edits(
    ledger: Ledger, names: Mapping[str, int], start: datetime
) -> None:
    """The disabled, renamed and deleted rows stopped, the new ones ran, the edited one moved."""
    after = {name: [f for n, f in ledger.occurrences() if n == name] for name in names}
    assert max(after["i02"]) <= start + timedelta(seconds=DISABLE_AT + 1)
    assert max(after["i03"]) <= start + timedelta(seconds=DISABLE_AT + 1)
    assert after["i03-renamed"] and min(after["i03-renamed"]) > max(after["i03"])
    assert max(after["i04"]) <= start + timedelta(seconds=DELETE_AT + 1)
    assert len(after["n01"]) >= 10
    edited_after = [f for f in after["i01"] if f > start + timedelta(seconds=CREATE_AT + 1)]
    assert edited_after and all(f.timestamp() % 4 == 0 for f in edited_after)


def assert_each_row_counts_its_runs(
    deployment: Deployment,
    ledger: Ledger,
    names: Mapping[str, int],
    kills: Mapping[str, datetime],
    one_offs: Set[b.Occurrence],
) -> None:
    """``total_run_count`` is the row's runs in the ledger, plus its claims the SIGKILL
    cut off unpublished (counted when found claimed; they never run). ``one_offs``: the
    one-off slots, which fall between whole seconds (the kill may cut one off too)."""
    from django_celery_beat.models import PeriodicTask

    def counted() -> dict[int, tuple[int, int]]:
        # Read again each time: the reconciler may replay a cut-off claim meanwhile
        cut_off = Counter(
            names[name] for name, _ in _unpublished(deployment, names, kills, one_offs)
        )
        runs = runs_by_row(ledger, names)
        return {
            row.pk: (row.total_run_count, runs[row.pk] + cut_off[row.pk])
            for row in PeriodicTask.objects.all()
        }

    def wrong() -> dict[str, tuple[int, int]]:
        name_of = {pk: name for name, pk in names.items()}
        return {
            name_of.get(pk, str(pk)): pair for pk, pair in counted().items() if pair[0] != pair[1]
        }

    with contextlib.suppress(AssertionError):
        poll(lambda: not wrong(), timeout=30, interval=0.5)
    assert not wrong(), f"rows whose (total_run_count, runs + cut off) disagree: {wrong()}"


def _unpublished(
    deployment: Deployment,
    names: Mapping[str, int],
    kills: Mapping[str, datetime],
    one_offs: Set[b.Occurrence],
) -> set[b.Occurrence]:
    """Claims a SIGKILL cut off before their publish, of any row: its slots on whole
    seconds in the tick before the kill, and the one-offs'."""
    candidates = set(one_offs)
    for killed in kills.values():
        second = killed.replace(microsecond=0)
        for back in range(int(b.TICK_SPAN.total_seconds()) + 2):
            candidates |= {(name, second - timedelta(seconds=back)) for name in names}
    return b.unpublished_claims(deployment, candidates, kills)


@pytest.mark.timeout(150)
@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis",))
@pytest.mark.parametrize("django_database", ["postgres"], indirect=True)
def test_scenario_74_two_beats_continue_a_renamed_row_after_its_old_names_claims(
    deployment: Deployment, ledger: Ledger, gate: None, django_database: DjangoDatabase
) -> None:
    """Two real beats; a row renamed with a ``last_run_at`` behind its old name's claims.

    That is the row node 2 reads when the rename commits while node 1 is
    between its claim of a slot and its count (or its count write failed): the
    rename here writes back the ``last_run_at`` read seconds earlier, so the
    window is wide open every run. The beats catch up every missed slot
    (``catchup = "all"``). Before the fix both beats started the renamed row
    after that ``last_run_at``: the slots since, already run under the old
    name, ran again under the new one. The new name runs from ``max_skew``
    seconds after the beats read the rename.

    The same run has a row every 3 s whose ``start_time`` is 1.5 s past a
    whole second: before the fix its slots were on the epoch's grid (whole
    seconds); now they are ``start_time + k * 3 s``.
    """
    # SCENARIOS 74: no slot of that row is dispatched under both names
    from django_celery_beat.models import PeriodicTask

    deployment.start_worker(concurrency=2)
    deployment.store()
    start = b.whole_second_after(b.store_now(deployment) + timedelta(seconds=6))
    anchor = start + timedelta(seconds=1.5)
    pk = add("old-name").pk
    names = {
        "old-name": pk,
        "new-name": pk,
        "anchored": add("anchored", interval=interval(3), start_time=anchor).pk,
    }
    beats = [
        start_beat(deployment, django_database, "exactonce-django", exactonce_catchup="all")
        for _ in range(2)
    ]
    for beat in beats:
        beat.wait_ready()
    b.run_until(deployment, start + timedelta(seconds=2), beats)
    stale = PeriodicTask.objects.get(pk=pk)  # its last_run_at, as of now
    b.run_until(deployment, start + timedelta(seconds=8), beats)
    stale.name = "new-name"
    stale.save(update_fields=["name", "last_run_at"])
    # (a node claims nothing of a row it read renamed for max_skew seconds after the read)
    b.run_until(deployment, start + timedelta(seconds=8 + b.max_skew(deployment) + 6), beats)
    disable_every_row(deployment, beats)
    for beat in beats:
        beat.kill()

    # Then no slot of the row ran under both names, and the new name went on
    occurrences = ledger.occurrences()
    b.assert_no_duplicates(ledger)
    fires = {
        name: sorted(f for n, f in occurrences if n == name) for name in ("old-name", "new-name")
    }
    assert fires["old-name"] and fires["new-name"], fires
    assert set(fires["old-name"]).isdisjoint(fires["new-name"]), fires
    assert min(fires["new-name"]) > max(fires["old-name"]), fires
    # ... the start_time row fired on its own grid, not the epoch's
    anchored = sorted(f for n, f in occurrences if n == "anchored")
    assert len(anchored) >= 4, anchored
    assert all((f - anchor).total_seconds() % 3 == 0 for f in anchored), anchored
    # ... and the row counts what ran of it, under both names
    assert_each_row_counts_its_runs(deployment, ledger, names, {}, set())


# -- the control ---------------------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis",))
@pytest.mark.parametrize("django_database", ["sqlite"], indirect=True)  # the control runs once
def test_control_two_stock_django_celery_beat_schedulers_run_each_occurrence_twice(
    deployment: Deployment, ledger: Ledger, gate: None, django_database: DjangoDatabase
) -> None:
    # Given 4 rows every 2 seconds and two stock beats
    deployment.start_worker(concurrency=4)
    names = {f"s{i}": add(f"s{i}", task="plain_beat").pk for i in range(1, 5)}
    beats = [
        start_beat(deployment, django_database, "django_celery_beat.schedulers:DatabaseScheduler")
        for _ in range(2)
    ]
    for beat in beats:
        beat.wait_ready()
    # When they run for 20 seconds
    started = b.store_now(deployment)
    b.run_until(deployment, started + timedelta(seconds=20), beats)
    for beat in beats:
        beat.kill()
    # Then each row ran about twice per 2 seconds: every occurrence twice
    runs = runs_by_row(ledger, names)
    assert all(runs[pk] >= 16 for pk in names.values()), runs
    counts = {row.name: row.total_run_count for row in rows().values()}
    print(f"stock beats: runs per row {dict(runs)}, total_run_count {counts}")
