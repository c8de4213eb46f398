"""The django-celery-beat scheduler: several nodes on rows edited while they run.

Nodes are :class:`DatabaseScheduler` instances of one app on an InMemoryStore
and a frozen clock (:mod:`tests.support.beat_cluster`), reading the rows of the
test's database (SQLite, then PostgreSQL). What they dispatch is counted at
the fake broker and compared with the rows' ``total_run_count``.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from celery_exactonce.contrib.django_celery_beat import DatabaseScheduler
from celery_exactonce.core.jobs import Job
from celery_exactonce.observe import metrics
from tests.support.beat_cluster import Cluster, isolated, register_plain_tasks

UTC = timezone.utc
START = datetime(2026, 6, 1, 12, 0, 0, tzinfo=UTC)


@pytest.fixture(autouse=True)
def _isolated() -> Iterator[None]:
    with isolated():
        yield


class DjangoCluster(Cluster):
    """A :class:`Cluster` whose nodes are django-celery-beat schedulers."""

    def __init__(self, nodes: int = 3, schedule: dict[str, Any] | None = None, **conf: Any):
        self._count = nodes
        super().__init__(schedule or {}, nodes=0, **conf)
        register_plain_tasks(self.app, {t: {"task": t} for t in ("plain.t", "plain.u")})
        self.nodes = [DatabaseScheduler(self.app) for _ in range(nodes)]

    def by_row(self, pks: dict[str, int]) -> Counter[int]:
        """Occurrences the broker received, per row: ``pks`` maps every name a row had."""
        names = [job.options["headers"]["periodic_task_name"] for job in self.broker.sent]
        return Counter(pks[name] for name in names)


def interval(seconds: int) -> Any:
    from django_celery_beat.models import IntervalSchedule

    return IntervalSchedule.objects.get_or_create(every=seconds, period="seconds")[0]


def add_row(name: str, **fields: Any) -> Any:
    from django_celery_beat.models import PeriodicTask

    if not {"interval", "crontab", "solar", "clocked"} & set(fields):
        fields["interval"] = interval(10)
    return PeriodicTask.objects.create(name=name, task=fields.pop("task", "plain.t"), **fields)


def counts() -> dict[str, int]:
    from django_celery_beat.models import PeriodicTask

    return dict(PeriodicTask.objects.values_list("name", "total_run_count"))


def duplicates(sent: list[Job]) -> list[str]:
    return [job_id for job_id, n in Counter(job.ref.id for job in sent).items() if n > 1]


def test_three_nodes_dispatch_each_row_slot_once_and_count_it_once(alias: str) -> None:
    from django_celery_beat.models import CrontabSchedule

    add_row("every10", args=json.dumps([1]))
    add_row("every30", interval=interval(30), kwargs=json.dumps({"k": "v"}))
    tab = CrontabSchedule.objects.create(minute="*", hour="*", timezone=ZoneInfo("UTC"))
    add_row("minutely", crontab=tab, queue="reports")
    cluster = DjangoCluster(nodes=3, start=START)
    cluster.tick_all()
    cluster.run_until(START + timedelta(minutes=5), step=1, rotate=True)
    assert duplicates(cluster.broker.sent) == []
    # The slots from the first tick's (at START) to the last one's, each once
    assert cluster.fired("every10") == [START + timedelta(seconds=s) for s in range(0, 301, 10)]
    assert len(cluster.fired("every30")) == 11
    assert cluster.fired("minutely") == [START + timedelta(minutes=m) for m in range(6)]
    assert counts() == {"every10": 31, "every30": 11, "minutely": 6}
    sent = {job.entry: job for job in cluster.broker.sent}
    assert sent["every10"].args == [1]
    assert sent["every30"].kwargs == {"k": "v"}
    assert sent["minutely"].options["queue"] == "reports"


def test_edits_apply_on_every_node_within_a_tick_and_past_slots_never_refire(alias: str) -> None:
    from django_celery_beat.models import PeriodicTask

    add_row("edited")
    add_row("disabled")
    add_row("renamed")
    add_row("deleted")
    pks = dict(PeriodicTask.objects.values_list("name", "pk"))
    cluster = DjangoCluster(nodes=3, start=START)
    cluster.tick_all()
    cluster.run_until(START + timedelta(seconds=60), step=1, rotate=True)
    assert counts() == {"edited": 7, "disabled": 7, "renamed": 7, "deleted": 7}
    # When each row is edited through the ORM, as the admin saves it
    edited = PeriodicTask.objects.get(name="edited")
    edited.interval = interval(20)
    edited.save()
    disabled = PeriodicTask.objects.get(name="disabled")
    disabled.enabled = False
    disabled.save()
    renamed = PeriodicTask.objects.get(name="renamed")
    renamed.name = "renamed-2"
    renamed.save()
    PeriodicTask.objects.get(name="deleted").delete()
    add_row("added", interval=interval(15))
    cluster.run_until(START + timedelta(seconds=120), step=1, rotate=True)
    # Then every node follows them from its next tick
    assert duplicates(cluster.broker.sent) == []
    after = START + timedelta(seconds=60)
    assert [f for f in cluster.fired("edited") if f > after] == [
        after + timedelta(seconds=s) for s in (20, 40, 60)
    ]
    assert [f for f in cluster.fired("disabled") if f > after] == []
    assert [f for f in cluster.fired("deleted") if f > after] == []
    assert [f for f in cluster.fired("renamed") if f > after] == []
    assert len([f for f in cluster.fired("renamed-2") if f > after]) == 6
    assert [f for f in cluster.fired("added") if f > after] == [
        after + timedelta(seconds=s) for s in (15, 30, 45, 60)
    ]
    # And each row counts what ran of it, under every name it had
    rows = dict(PeriodicTask.objects.values_list("name", "pk"))
    by_row = cluster.by_row({**pks, **rows})
    assert {name: by_row[pk] for name, pk in rows.items()} == counts()
    assert counts()["renamed-2"] == 13


def test_a_one_off_fires_once_across_the_nodes_then_is_disabled_once(alias: str) -> None:
    from django_celery_beat.models import ClockedSchedule, PeriodicTask

    clocked = ClockedSchedule.objects.create(clocked_time=START + timedelta(seconds=30))
    add_row("clocked", clocked=clocked, one_off=True)
    add_row("one-off", interval=interval(20), one_off=True, start_time=START)
    cluster = DjangoCluster(nodes=3, start=START)
    cluster.tick_all()
    cluster.run_until(START + timedelta(seconds=90), step=1, rotate=True)
    assert cluster.fired("clocked") == [START + timedelta(seconds=30)]
    assert cluster.fired("one-off") == [START]
    rows = {row.name: row for row in PeriodicTask.objects.all()}
    assert [(r.enabled, r.total_run_count) for r in rows.values()] == [(False, 1), (False, 1)]
    assert metrics.COUNTERS.get("row_disabled") == 2


def test_a_row_beat_cannot_run_is_left_out_and_the_others_run(
    alias: str, caplog: pytest.LogCaptureFixture
) -> None:
    from django_celery_beat.models import PeriodicTask

    add_row("good")
    add_row("bad-args", args="[1, ")
    add_row("unknown-task", task="nobody.registers.this")
    cluster = DjangoCluster(nodes=2, start=START)
    with caplog.at_level(logging.ERROR, logger="celery_exactonce"):
        cluster.tick_all()
        cluster.run_until(START + timedelta(seconds=30), step=1)
    assert len(cluster.fired("good")) == 4
    assert cluster.fired("bad-args") == cluster.fired("unknown-task") == []
    refused = [
        r.getMessage() for r in caplog.records if getattr(r, "action", "") == "entry_refused"
    ]
    assert any("periodic task 'bad-args': args is not JSON" in m for m in refused)
    assert any("'unknown-task'" in m and "not registered" in m for m in refused)
    # Refused once per node, not at every tick; fixed, it runs from the next tick
    assert len(refused) == 4
    bad = PeriodicTask.objects.get(name="bad-args")
    bad.args = "[1]"
    bad.save()
    cluster.run_until(START + timedelta(seconds=60), step=1)
    assert cluster.fired("bad-args") == [START + timedelta(seconds=s) for s in (30, 40, 50, 60)]


def test_settings_entries_are_written_into_rows_and_keep_their_overrides(alias: str) -> None:
    from django_celery_beat.models import PeriodicTask

    schedule = {
        "from-settings": {
            "task": "plain.u",
            "schedule": timedelta(seconds=10),
            "options": {"queue": "q1", "exactonce": {"catchup": "none"}},
        }
    }
    cluster = DjangoCluster(nodes=2, start=START, schedule=schedule)
    row = PeriodicTask.objects.get(name="from-settings")
    assert (row.task, row.queue, row.interval.every) == ("plain.u", "q1", 10)
    cluster.tick_all()
    cluster.run_until(START + timedelta(seconds=30), step=1)
    assert len(cluster.fired("from-settings")) == 4
    policy = cluster.nodes[0]._policies["from-settings"]
    assert policy.catchup == "none"


def test_an_expired_row_stops_and_is_disabled_once_its_last_slot_is_past(alias: str) -> None:
    from django_celery_beat.models import PeriodicTask

    add_row("expiring", expires=START + timedelta(seconds=25))
    cluster = DjangoCluster(nodes=2, start=START, exactonce_window_lookback=30)
    cluster.tick_all()
    cluster.run_until(START + timedelta(seconds=50), step=1)
    assert cluster.fired("expiring") == [START + timedelta(seconds=s) for s in (0, 10, 20)]
    assert PeriodicTask.objects.get(name="expiring").enabled is True  # 20 s is in the window
    cluster.run_until(START + timedelta(seconds=56), step=1)
    # The change marker did not move: the five-minute read finds it
    cluster.clock.advance(300)
    cluster.tick_all()
    row = PeriodicTask.objects.get(name="expiring")
    assert (row.enabled, row.total_run_count) == (False, 3)
    assert metrics.COUNTERS.get("row_disabled") == 1


def test_scenario_73_two_hundred_rows_edited_while_three_nodes_run(alias: str) -> None:
    # SCENARIOS 73: edits apply on every node within a tick, past slots never re-fire,
    # total_run_count matches the runs
    from django_celery_beat.models import PeriodicTask

    for i in range(200):
        add_row(f"row-{i:03}", interval=interval(10))
    pks = dict(PeriodicTask.objects.values_list("name", "pk"))
    cluster = DjangoCluster(nodes=3, start=START)
    cluster.tick_all()
    cluster.run_until(START + timedelta(seconds=60), step=1, rotate=True)
    edited_at = cluster.clock.now()
    # When every row is edited (as the admin saves it): even rows every 15 s, odd ones
    # disabled, and ten renamed
    for row in PeriodicTask.objects.all():
        index = int(row.name.rsplit("-", 1)[1])
        if index % 2:
            row.enabled = False
        else:
            row.interval = interval(15)
        if index < 20 and index % 2 == 0:
            row.name = f"renamed-{index:03}"
            pks[row.name] = row.pk
        row.save()
    # Then the next tick of every node runs the new rows: an odd row fires no more, an
    # even one only on the 15-second grid, and none fires a slot at or before the edit
    sent_before = len(cluster.broker.sent)
    cluster.run_until(edited_at + timedelta(seconds=1), step=1, rotate=True)
    for node in cluster.nodes:
        assert not any(name.startswith("row-") and int(name[4:]) % 2 for name in node.schedule)
    cluster.run_until(edited_at + timedelta(seconds=60), step=1, rotate=True)
    after = cluster.broker.sent[sent_before:]
    assert after, "nothing fired after the edit"
    assert all(job.fire_time > edited_at for job in after)
    assert all(job.fire_time.timestamp() % 15 == 0 for job in after)
    assert not [job for job in after if int(job.entry.rsplit("-", 1)[1]) % 2]
    assert duplicates(cluster.broker.sent) == []
    by_row = cluster.by_row(pks)
    assert {row.pk: row.total_run_count for row in PeriodicTask.objects.all()} == {
        pk: by_row[pk] for pk in set(pks.values())
    }


def _rename(name: str, to: str) -> Any:
    from django_celery_beat.models import PeriodicTask

    row = PeriodicTask.objects.get(name=name)
    row.name = to
    row.save()  # as the admin saves it: the change marker moves
    return row


def _count_write_fails_once(monkeypatch: pytest.MonkeyPatch) -> list[datetime]:
    """The next count write (:func:`periodic_tasks.record_run`) fails; the slot it had."""
    from django.db import DatabaseError

    from celery_exactonce.contrib import periodic_tasks

    record_run = periodic_tasks.record_run
    failed: list[datetime] = []

    def fails_once(row: int, fire: datetime, *, won: bool) -> bool:
        if not failed:
            failed.append(fire)
            raise DatabaseError("the count write failed")
        return record_run(row, fire, won=won)

    monkeypatch.setattr(periodic_tasks, "record_run", fails_once)
    return failed


def _fires_by_row(cluster: DjangoCluster, pks: dict[str, int]) -> Counter[tuple[int, datetime]]:
    return Counter(
        (pks[job.options["headers"]["periodic_task_name"]], job.fire_time)  # type: ignore[misc]
        for job in cluster.broker.sent
    )


def test_scenario_74_a_rename_after_a_failed_count_write_runs_no_slot_twice(
    alias: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One node: the count write of slot S fails once, the row is renamed, the node goes on.

    Before the fix, the renamed row's entry started after ``last_run_at``, which
    the failed write had left before S: the next tick claimed S again under the
    new name, and the row counted fewer runs than the messages sent.
    """
    # SCENARIOS 74: a rename continues after every slot the old name claimed
    from django_celery_beat.models import PeriodicTask

    pk = add_row("report").pk
    cluster = DjangoCluster(nodes=1, start=START)
    cluster.tick_all()
    failed = _count_write_fails_once(monkeypatch)
    cluster.run_until(START + timedelta(seconds=10), step=1)
    assert failed == [START + timedelta(seconds=10)]
    _rename("report", "report-renamed")
    cluster.run_until(START + timedelta(seconds=40), step=1)
    fires = _fires_by_row(cluster, {"report": pk, "report-renamed": pk})
    assert [key for key, n in fires.items() if n > 1] == []
    assert cluster.fired("report") == [START, START + timedelta(seconds=10)]
    assert cluster.fired("report-renamed") == [START + timedelta(seconds=s) for s in (20, 30, 40)]
    row = PeriodicTask.objects.get(pk=pk)
    assert row.total_run_count == len(cluster.broker.sent) == 5


def test_scenario_74_a_rename_between_one_nodes_claim_and_count_runs_no_slot_twice(
    alias: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two nodes, no error: the rename commits while node 1 is between its claim of S and
    its count, and node 2 reads the renamed row then, before node 1's count lands.

    Before the fix, node 2 started the renamed row after the ``last_run_at`` it
    read (before S) and claimed S again under the new name; S ran twice and was
    counted once.
    """
    # SCENARIOS 74: no slot of that row is dispatched under both names
    from django_celery_beat.models import PeriodicTask

    from celery_exactonce.contrib import periodic_tasks

    pk = add_row("report").pk
    cluster = DjangoCluster(nodes=2, start=START)
    cluster.tick_all()
    first, second = cluster.nodes
    slot = START + timedelta(seconds=10)
    record_run = periodic_tasks.record_run
    renamed: list[datetime] = []

    def rename_first(row: int, fire: datetime, *, won: bool) -> bool:
        if fire == slot and not renamed:  # node 1 claimed S and dispatched it; not counted yet
            renamed.append(fire)
            _rename("report", "report-renamed")
            second.tick()  # node 2 reads the renamed row now
        return record_run(row, fire, won=won)

    monkeypatch.setattr(periodic_tasks, "record_run", rename_first)
    cluster.clock.set(slot)
    first.tick()
    assert renamed == [slot]
    cluster.run_until(START + timedelta(seconds=40), step=1, rotate=True)
    fires = _fires_by_row(cluster, {"report": pk, "report-renamed": pk})
    assert [key for key, n in fires.items() if n > 1] == []
    assert sorted(fire for _, fire in fires) == [
        START + timedelta(seconds=s) for s in range(0, 41, 10)
    ]
    assert cluster.fired("report-renamed") == [START + timedelta(seconds=s) for s in (20, 30, 40)]
    assert PeriodicTask.objects.get(pk=pk).total_run_count == len(cluster.broker.sent) == 5


def test_scenario_74_a_node_started_after_a_rename_runs_no_slot_the_old_name_claimed(
    alias: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node that never read the row's old name: it starts after the rename, while the
    old name's claim of S is not counted yet (its count write failed).

    Before the fix, that node knew only ``last_run_at`` (before S) and no earlier
    name: it claimed S again under the new name. Now a row with a history and no
    watermark under its name claims no slot up to the store time it was first
    read plus ``max_skew``; the slots passed over are counted ``unprovable``.
    """
    # SCENARIOS 74: a rename continues after every slot the old name claimed
    from django.db import DatabaseError

    from celery_exactonce.contrib import periodic_tasks

    pk = add_row("report").pk
    cluster = DjangoCluster(nodes=1, start=START)
    cluster.tick_all()
    slot = START + timedelta(seconds=10)

    def fails(row: int, fire: datetime, *, won: bool) -> bool:
        raise DatabaseError("the count write failed")

    monkeypatch.setattr(periodic_tasks, "record_run", fails)
    cluster.run_until(slot, step=1)  # S claimed and sent under the old name, not counted
    assert cluster.fired("report") == [START, slot]
    cluster.nodes[0].close()
    cluster.nodes.clear()
    _rename("report", "report-renamed")
    cluster.nodes.append(DatabaseScheduler(cluster.app))  # never read the old name
    cluster.run_until(START + timedelta(seconds=40), step=1)
    fires = _fires_by_row(cluster, {"report": pk, "report-renamed": pk})
    assert [key for key, n in fires.items() if n > 1] == []
    assert cluster.fired("report-renamed") == [START + timedelta(seconds=s) for s in (20, 30, 40)]


def test_scenario_74_a_claim_under_the_old_name_landing_after_the_rename_runs_once(
    alias: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node 1 read the rows before the rename and claims S under the old name; its claim
    lands only after node 2 has read the renamed row and the old name's watermark.

    Before the fix, node 2's watermark read came before node 1's claim, so it
    saw S unclaimed and claimed it again under the new name. Node 1 planned at a
    store time before the rename, so it claims no slot past that time plus
    ``max_skew``: node 2 claims none up to the store time after its read, plus
    ``max_skew``.
    """
    # SCENARIOS 74: no slot of that row is dispatched under both names
    pk = add_row("report").pk
    cluster = DjangoCluster(nodes=2, start=START)
    cluster.tick_all()
    first, second = cluster.nodes
    slot = START + timedelta(seconds=10)
    create_many = cluster.store.create_many
    raced: list[bool] = []

    def rename_before_the_claim_lands(*args: Any, **kwargs: Any) -> Any:
        if not raced:  # node 1's claim of S, planned before the rename
            raced.append(True)
            _rename("report", "report-renamed")
            second.tick()  # reads the renamed row, and the old name's watermark
        return create_many(*args, **kwargs)

    cluster.clock.set(slot)
    monkeypatch.setattr(cluster.store, "create_many", rename_before_the_claim_lands)
    first.tick()
    monkeypatch.setattr(cluster.store, "create_many", create_many)
    assert raced == [True]
    cluster.run_until(START + timedelta(seconds=40), step=1, rotate=True)
    fires = _fires_by_row(cluster, {"report": pk, "report-renamed": pk})
    assert [key for key, n in fires.items() if n > 1] == []
    assert cluster.fired("report") == [START, slot]
    assert cluster.fired("report-renamed") == [START + timedelta(seconds=s) for s in (20, 30, 40)]


def test_a_settings_one_off_keeps_its_row_and_its_slot_across_beat_starts(alias: str) -> None:
    """Each beat start wrote every ``beat_schedule`` entry into its row again: before the
    fix that moved ``date_changed`` (where a one-off without a ``start_time`` starts, so its
    slot moved at every start) and the change marker (every node read the rows again)."""
    from django_celery_beat.models import PeriodicTask

    from celery_exactonce.contrib import periodic_tasks

    schedule = {
        "once": {"task": "plain.u", "schedule": timedelta(hours=1), "one_off": True},
        "hourly": {"task": "plain.u", "schedule": timedelta(hours=1), "args": [1]},
    }
    cluster = DjangoCluster(nodes=1, start=START, schedule=schedule)
    written = {row.name: row.date_changed for row in PeriodicTask.objects.all()}
    assert PeriodicTask.objects.get(name="once").one_off is True
    marker = periodic_tasks.last_change()
    cluster.nodes.append(DatabaseScheduler(cluster.app))  # another beat starts
    assert {row.name: row.date_changed for row in PeriodicTask.objects.all()} == written
    assert periodic_tasks.last_change() == marker
    first, second = (node.schedule["once"].schedule for node in cluster.nodes)
    assert first == second
    assert first.start == periodic_tasks.aware(written["once"])


def test_an_earlier_slots_count_landing_after_a_later_ones_is_not_lost(
    alias: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Suspicion: ``record_run``'s ``last_run_at < slot`` guard drops an earlier slot's
    count that lands after a later one. Confirmed: node 1 won S1 and its count write
    failed; node 2, which had not decided S1 (it was behind), counted S2; before the fix
    node 1's retry of S1 was refused and ``total_run_count`` ended one below the runs.
    Now a node that finds slots it never decided below a watermark counts the claimed ones."""
    from django_celery_beat.models import PeriodicTask

    from celery_exactonce.contrib import periodic_tasks

    pk = add_row("report").pk
    cluster = DjangoCluster(nodes=2, start=START)
    cluster.tick_all()
    first, second = cluster.nodes
    failed = _count_write_fails_once(monkeypatch)
    cluster.clock.set(START + timedelta(seconds=10))
    first.tick()  # S1 won and dispatched; its count failed
    cluster.clock.set(START + timedelta(seconds=20))
    second.tick()  # behind: it starts after the watermark, S1, and counts S2
    first.tick()  # S1's count tried again
    assert failed == [START + timedelta(seconds=10)]
    assert cluster.fired("report") == [START + timedelta(seconds=s) for s in (0, 10, 20)]
    row = PeriodicTask.objects.get(pk=pk)
    assert (row.total_run_count, periodic_tasks.aware(row.last_run_at)) == (
        3,
        START + timedelta(seconds=20),
    )
