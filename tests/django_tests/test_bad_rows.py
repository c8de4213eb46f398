"""Rows beat cannot run, on the django-celery-beat scheduler: refused one by one, never beat.

Rows come from the admin, but also from the ORM, fixtures and plain SQL, none
of which checks what the admin checks. A row that cannot be parsed (a crontab
field ``*/``, an unknown solar event, a clocked row whose clock is gone), or
whose task beat does not import, is refused with an ``entry_refused`` error
naming it; the other rows keep running, at start and when the row is saved
while beat runs; a row fixed in place runs from the next change. Nodes are
:class:`DatabaseScheduler` instances on a frozen clock
(:mod:`tests.django_tests.test_scheduler`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery import Celery
from click.testing import CliRunner

from celery_exactonce.cli import exactonce
from celery_exactonce.observe import metrics
from tests.django_tests.test_scheduler import START, DjangoCluster, add_row
from tests.support.beat_cluster import isolated


@pytest.fixture(autouse=True)
def _isolated() -> Iterator[None]:
    with isolated():
        yield


def orphan_clock(alias: str, row: Any) -> None:
    """Point ``row``'s ``clocked_id`` at no clock, as SQL that skips the foreign key can."""
    from django.db import connections

    table = row._meta.db_table
    with connections[alias].cursor() as cursor:
        if connections[alias].vendor == "sqlite":
            cursor.execute("PRAGMA foreign_keys = OFF")
            cursor.execute(f"UPDATE {table} SET clocked_id = %s WHERE id = %s", [987654, row.pk])
            cursor.execute("PRAGMA foreign_keys = ON")
        else:
            cursor.execute("SET session_replication_role = replica")  # no FK triggers
            cursor.execute(f"UPDATE {table} SET clocked_id = %s WHERE id = %s", [987654, row.pk])
            cursor.execute("SET session_replication_role = DEFAULT")


def bad_rows(alias: str) -> None:
    """Three rows that cannot be parsed, each as the admin would never save it."""
    from django_celery_beat.models import ClockedSchedule, CrontabSchedule, SolarSchedule

    slash = CrontabSchedule.objects.create(minute="*/", timezone=ZoneInfo("UTC"))
    add_row("bad-crontab", crontab=slash)
    nowhere = SolarSchedule.objects.create(event="no-such-event", latitude=10, longitude=10)
    add_row("bad-solar", solar=nowhere)
    clock = ClockedSchedule.objects.create(clocked_time=START + timedelta(seconds=20))
    orphan_clock(alias, add_row("bad-clocked", clocked=clock, one_off=True))


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if getattr(r, "action", "") == "entry_refused"]


def test_scenario_75_rows_that_cannot_be_parsed_are_refused_and_the_others_run(
    alias: str, caplog: pytest.LogCaptureFixture
) -> None:
    """SCENARIOS 75, in process.

    Before the fix, building the scheduler raised: Celery's ``ParseException``
    for the crontab ``*/`` (only ``ValueError``/``TypeError`` were caught), a
    ``ValueError`` for the unknown solar event, an ``AttributeError`` for the
    clocked row without its clock; and a bad row saved while beat ran made
    ``tick()`` raise, which ends celery beat's loop.
    """
    from django_celery_beat.models import CrontabSchedule, PeriodicTask

    add_row("good")
    bad_rows(alias)
    # Given two nodes started with the three bad rows
    with caplog.at_level(logging.ERROR, logger="celery_exactonce"):
        cluster = DjangoCluster(nodes=2, start=START)
        cluster.tick_all()
        cluster.run_until(START + timedelta(seconds=30), step=1)
        at_start = refusals(caplog)
        # When a fourth bad row is saved while they run
        add_row("bad-later", crontab=CrontabSchedule.objects.create(minute="1,*/", hour="*/"))
        cluster.run_until(START + timedelta(seconds=60), step=1)
    # Then each bad row is refused and counted, once per node, named; the good row runs
    for name, why in (
        ("bad-crontab", "crontab"),
        ("bad-solar", "solar"),
        ("bad-clocked", "clocked"),
    ):
        named = [m for m in at_start if f"periodic task {name!r}" in m]
        assert len(named) == 2 and why in named[0], (name, at_start)
    later = [m for m in refusals(caplog) if "periodic task 'bad-later'" in m]
    assert len(later) == 2, refusals(caplog)
    assert metrics.COUNTERS.get("entry_refused") == 8
    assert cluster.fired("good") == [START + timedelta(seconds=s) for s in range(0, 61, 10)]
    assert not [j for j in cluster.broker.sent if j.entry != "good"]
    # When the crontab row is fixed in place (its crontab saved), it runs from the change
    fixed = PeriodicTask.objects.get(name="bad-crontab").crontab
    fixed.minute = "*"
    fixed.save()
    cluster.run_until(START + timedelta(seconds=180), step=1)
    assert cluster.fired("bad-crontab") == [START + timedelta(minutes=m) for m in (1, 2, 3)]


def test_a_row_whose_task_beat_does_not_import_can_declare_it_in_its_headers(
    alias: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A row cannot carry ``options``: its ``headers`` JSON holds ``{"exactonce": {...}}``.

    Before the fix, the refusal advised ``options={'exactonce': {'gated': …}}``,
    which a row made in the admin cannot carry, and the row's headers were
    published as they were.
    """
    add_row("undeclared", task="not.imported")
    declared = {"exactonce": {"gated": False}, "trace": "x"}
    add_row("declared", task="not.imported", headers=json.dumps(declared))
    add_row("good")
    with caplog.at_level(logging.ERROR, logger="celery_exactonce"):
        cluster = DjangoCluster(nodes=1, start=START)
        cluster.tick_all()
        cluster.run_until(START + timedelta(seconds=20), step=1)
    (refused,) = refusals(caplog)
    assert "periodic task 'undeclared'" in refused and "not.imported" in refused
    assert '"exactonce": {"gated": true}' in refused and "headers" in refused
    assert "imports" in refused and "options=" not in refused
    assert len(cluster.fired("declared")) == len(cluster.fired("good")) == 3
    sent = next(j for j in cluster.broker.sent if j.entry == "declared")
    assert sent.options["headers"] == {"trace": "x", "periodic_task_name": "declared"}
    assert cluster.nodes[0]._policies["declared"].gated is False


def test_check_names_each_bad_row_and_fails(alias: str) -> None:
    """``exactonce check`` under the django-celery-beat scheduler reads the rows.

    Before the fix it checked ``beat_schedule`` only: every row passed.
    """
    add_row("good")
    bad_rows(alias)
    app = Celery("check_rows", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        exactonce_store_url="memory://",
        beat_scheduler="exactonce-django",
        timezone="UTC",
    )

    @app.task(name="plain.t", shared=False)
    def plain() -> None:
        """Never runs: the good row's task, imported as beat would."""

    result = CliRunner().invoke(exactonce, ["check", "--json"], obj=SimpleNamespace(app=app))
    assert result.exit_code == 1, result.output
    checks = {c["name"]: c for c in json.loads(result.output)["checks"]}
    rows = checks["periodic tasks"]
    assert rows["status"] == "FAIL", rows
    for name in ("bad-crontab", "bad-solar", "bad-clocked"):
        assert f"periodic task {name!r}" in rows["message"], rows
    assert "'good'" not in rows["message"]
    assert rows["setting"] == "django_celery_beat.PeriodicTask"


def test_a_custom_model_entry_is_refused_at_start_with_one_line(
    alias: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """django-celery-beat projects subclass ``ModelEntry`` and set it as ``Entry``.

    Before the fix, building such a scheduler ended on Celery's raw
    ``TypeError`` (``ModelEntry.__init__() got an unexpected keyword argument``),
    naming neither the class nor what replaces it.
    """
    from django_celery_beat.schedulers import ModelEntry

    from celery_exactonce.contrib.django_celery_beat import DatabaseScheduler
    from celery_exactonce.startup import StartupRefused

    class AuditedEntry(ModelEntry):  # type: ignore[misc]
        """What a project's own entry looks like."""

    class AuditedScheduler(DatabaseScheduler):
        Entry = AuditedEntry

    add_row("good")
    cluster = DjangoCluster(nodes=0, start=START)
    with pytest.raises(StartupRefused):
        AuditedScheduler(cluster.app)
    err = capsys.readouterr().err
    (line,) = err.splitlines()
    assert line.startswith("celery-exactonce: beat refused to start: ")
    assert "AuditedScheduler sets Entry = " in line and "AuditedEntry" in line
    assert "headers" in line and "before_task_publish" in line


@pytest.mark.django_db(databases=["default"], transaction=True)
def test_check_fails_on_rows_in_sqlite_without_immediate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the fix, ``check`` passed a project whose beats would meet ``database is locked``."""
    from django.db import connections

    options = dict(connections["default"].settings_dict["OPTIONS"])
    options.pop("transaction_mode")
    monkeypatch.setitem(connections["default"].settings_dict, "OPTIONS", options)
    app = Celery("check_sqlite", set_as_current=False)
    app.conf.update(
        broker_url="memory://", exactonce_store_url="memory://", beat_scheduler="exactonce-django"
    )
    result = CliRunner().invoke(exactonce, ["check", "--json"], obj=SimpleNamespace(app=app))
    assert result.exit_code == 1, result.output
    checks = {c["name"]: c for c in json.loads(result.output)["checks"]}
    assert "transaction_mode'] = 'IMMEDIATE'" in checks["periodic tasks"]["message"]
