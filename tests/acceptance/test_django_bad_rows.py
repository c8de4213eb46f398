"""Real ``celery beat -S exactonce-django`` processes on rows beat cannot run, and on SQLite.

SCENARIOS 75: rows that cannot be parsed (a crontab field ``*/``, an unknown
solar event, a clocked row whose clock is gone), present when beat starts or
saved while it runs, are refused one by one, named in the log and by
``exactonce check``; the other rows keep running, and a row fixed in place
runs. No worker: a row's ``total_run_count`` counts each slot beat claimed.

Two beats started together on one SQLite file: without ``transaction_mode =
"IMMEDIATE"`` both refuse to start with one line naming the setting; with it,
both run.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from datetime import timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from tests.acceptance import beats as b
from tests.acceptance.django_project import DJANGO_APP, DjangoBeat, DjangoDatabase
from tests.acceptance.harness import REPO_ROOT, Deployment, poll
from tests.acceptance.test_django_beat import add, interval, start_beat

BAD = ("bad-crontab", "bad-solar", "bad-clocked")


def count(name: str) -> int:
    from django_celery_beat.models import PeriodicTask

    return int(PeriodicTask.objects.get(name=name).total_run_count)


def refused(beat: Any) -> set[str]:
    """The rows ``beat`` refused so far."""
    return {str(event.get("entry")) for event in beat.events("entry_refused")}


def given_bad_rows(database: DjangoDatabase) -> None:
    """The three kinds of rows the admin refuses, made as the ORM and plain SQL can."""
    from django_celery_beat.models import ClockedSchedule, CrontabSchedule, SolarSchedule

    add(
        "bad-crontab", crontab=CrontabSchedule.objects.create(minute="*/", timezone=ZoneInfo("UTC"))
    )
    moonrise = SolarSchedule.objects.create(event="moonrise", latitude=1, longitude=1)
    add("bad-solar", solar=moonrise, interval=None)
    clock = ClockedSchedule.objects.create(clocked_time="2030-01-01T00:00:00Z")
    row = add("bad-clocked", clocked=clock, one_off=True)
    # sqlite3 enforces no foreign key unless told: the row keeps an id that points nowhere
    with sqlite3.connect(database.spec.removeprefix("sqlite:")) as conn:
        conn.execute(
            "UPDATE django_celery_beat_periodictask SET clocked_id = 987654 WHERE id = ?", (row.pk,)
        )


@pytest.mark.timeout(120)
@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis",))
@pytest.mark.parametrize("django_database", ["sqlite"], indirect=True)
def test_scenario_75_a_row_that_cannot_be_parsed_is_refused_and_the_others_keep_running(
    deployment: Deployment, django_database: DjangoDatabase
) -> None:
    """SCENARIOS 75.

    Before the fix, the beat died at start on each bad row (Celery's
    ``ParseException``, a ``ValueError`` for the solar event, an
    ``AttributeError`` for the missing clock), on every node and restart; a bad
    row saved while beat ran made ``tick()`` raise, which ended beat; and
    ``exactonce check`` passed them all.
    """
    from django_celery_beat.models import ClockedSchedule, CrontabSchedule, PeriodicTask

    # Given a good row every second and three rows that cannot be parsed
    add("good", interval=interval(1))
    given_bad_rows(django_database)
    # Then `exactonce check` under the django-celery-beat scheduler names each and exits 1
    conf = json.dumps({"exactonce_reconcile_on": "beat", "beat_scheduler": "exactonce-django"})
    env = {**deployment.env, **django_database.env(), "EXACTONCE_ACC_EXTRA_CONF": conf}
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", DJANGO_APP, "exactonce", "check"],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("FAIL")]
    assert all(f"periodic task {name!r}" in line for name in BAD), line
    # When a beat starts on them
    beat = start_beat(deployment, django_database, "exactonce-django").wait_ready()
    # Then it refuses each bad row, names it in its log, and runs the good one
    poll(lambda: refused(beat) >= set(BAD), timeout=20, interval=0.2)
    poll(lambda: count("good") >= 2, timeout=20, interval=0.2)
    assert all(f"periodic task {name!r}" in beat.log() for name in BAD)
    # When a bad row is saved while it runs
    add("bad-later", crontab=CrontabSchedule.objects.create(minute="1,*/"))
    poll(lambda: "bad-later" in refused(beat), timeout=20, interval=0.2)
    # Then the good row keeps running on the same beat
    seen = count("good")
    poll(lambda: count("good") >= seen + 2, timeout=20, interval=0.2)
    # When the clocked row is fixed in place (given a clock a few seconds ahead)
    fixed = ClockedSchedule.objects.create(
        clocked_time=b.store_now(deployment) + timedelta(seconds=2)
    )
    PeriodicTask.objects.filter(name="bad-clocked").update(clocked=fixed)
    PeriodicTask.objects.get(name="bad-clocked").save(update_fields=["clocked"])  # the marker moves
    # Then it runs, once, and the beat never stopped
    poll(lambda: count("bad-clocked") == 1, timeout=20, interval=0.2)
    assert beat.alive(), beat.log_tail()
    assert "Traceback" not in beat.log()
    assert {"bad-crontab", "bad-solar", "bad-later"}.isdisjoint(
        {event.get("key") for event in beat.events("dispatched")}
    )


def beats_together(deployment: Deployment, database: DjangoDatabase, spec: str) -> list[DjangoBeat]:
    """Two exactonce-django beats started at the same moment on database ``spec``."""
    env = {
        **deployment.env,
        **database.env(),
        "EXACTONCE_TEST_DJANGO_DB": spec,
        "EXACTONCE_ACC_BEAT_EVERY": "0",
        "EXACTONCE_ACC_EXTRA_CONF": json.dumps({"exactonce_reconcile_on": "beat"}),
    }
    made = [
        DjangoBeat(env, deployment.tmp_path, f"{spec.partition(':')[0]}-{i}", "exactonce-django")
        for i in (1, 2)
    ]
    deployment.beats.extend(made)
    return [beat.start() for beat in made]


@pytest.mark.timeout(120)
@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis",))
@pytest.mark.parametrize("django_database", ["sqlite"], indirect=True)
def test_two_beats_started_together_on_sqlite_refuse_without_immediate_and_run_with_it(
    deployment: Deployment, django_database: DjangoDatabase
) -> None:
    """Before the fix, both started on the file without ``IMMEDIATE``, and one of two
    beats starting at the same moment could die at once on a raw ``database is
    locked`` traceback (django-celery-beat's ``update_changed`` upgrading a read lock)."""
    add("good", interval=interval(1))
    path = django_database.spec.removeprefix("sqlite:")
    # Given two beats started together on the SQLite file without IMMEDIATE
    deferred = beats_together(deployment, django_database, f"sqlite-deferred:{path}")
    # Then each refuses to start with one line naming the setting, and no traceback
    poll(lambda: not any(beat.alive() for beat in deferred), timeout=30, interval=0.1)
    for beat in deferred:
        assert beat.proc is not None and beat.proc.returncode == 1, beat.log_tail()
        (line,) = [x for x in beat.log().splitlines() if "beat refused to start" in x]
        assert "DATABASES['default']['OPTIONS']['transaction_mode'] = 'IMMEDIATE'" in line
        assert "Traceback" not in beat.log() and not beat.events("dispatched")
    # When two beats are started together with IMMEDIATE
    immediate = beats_together(deployment, django_database, f"sqlite:{path}")
    # Then both start and run the row, and neither meets a locked database
    for beat in immediate:
        beat.wait_ready()
    poll(lambda: count("good") >= 3, timeout=20, interval=0.2)
    for beat in immediate:
        assert beat.alive(), beat.log_tail()
        assert "database is locked" not in beat.log()
