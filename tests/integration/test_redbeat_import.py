"""``exactonce import redbeat``: entries RedBeat itself wrote, moved into stored entries.

RedBeat's own classes (``RedBeatSchedulerEntry.save()``) write the entries on
the test Redis under a prefix of the test's; the command reads them into the
stored entries of a cluster of three in-process beat nodes, which then run
them: the slot RedBeat ran last never again, the next ones once each.
"""

from __future__ import annotations

import json
import types
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest
from celery import Celery
from celery.schedules import crontab, schedule
from click.testing import CliRunner

from celery_exactonce import entries
from celery_exactonce.cli import exactonce
from tests import services
from tests.support.beat_cluster import START, Cluster, every, isolated, register_plain_tasks

pytest.importorskip("redbeat")


@pytest.fixture
def prefix() -> Iterator[str]:
    services.need("redis")
    import redis

    name = f"rb-{uuid.uuid4().hex[:8]}:"
    yield name
    client = redis.Redis.from_url(services.REDIS_URL)
    for key in client.scan_iter(match=f"{name}*"):
        client.delete(key)


def redbeat_app(prefix: str) -> Celery:
    """RedBeat's side: an app configured as a RedBeat user's, on the test Redis."""
    app = Celery("redbeat-side", set_as_current=False)
    app.conf.update(redbeat_redis_url=services.REDIS_URL, redbeat_key_prefix=prefix)
    return app


def write(app: Celery, name: str, sched: object, last: datetime | None, **fields: object) -> None:
    from redbeat import RedBeatSchedulerEntry

    entry = RedBeatSchedulerEntry(name, "plain.t", sched, app=app, **fields)  # type: ignore[arg-type]
    entry.last_run_at = last
    entry.save()


def our_cluster(prefix: str, **conf: object) -> Cluster:
    made = Cluster({"static-one": every(60)}, nodes=3, **conf)  # type: ignore[arg-type]
    made.app.conf.update(redbeat_redis_url=services.REDIS_URL, redbeat_key_prefix=prefix)
    register_plain_tasks(made.app, {"x": {"task": "plain.t"}})
    return made


def run(app: Celery, *args: str) -> dict:  # type: ignore[type-arg]
    done = CliRunner().invoke(
        exactonce, ["import", "redbeat", *args, "--json"], obj=types.SimpleNamespace(app=app)
    )
    assert done.exit_code == 0, done.output
    return json.loads(done.output)  # type: ignore[no-any-return]


def test_every_kind_of_redbeat_entry_imports_or_says_why_and_runs_from_its_next_slot(
    prefix: str,
) -> None:
    with isolated():
        rb = redbeat_app(prefix)
        last = START - timedelta(seconds=5)  # RedBeat ran the 11:59:55 slot (of 5 s) last
        write(rb, "every-5s", schedule(timedelta(seconds=5)), last, args=[1], kwargs={"k": "v"})
        write(rb, "cron-5m", crontab(minute="*/5"), START - timedelta(minutes=5))
        write(rb, "disabled", schedule(timedelta(seconds=5)), last, enabled=False)
        write(rb, "never-run", schedule(timedelta(seconds=10)), None, options={"queue": "q"})
        write(rb, "long-stopped", schedule(timedelta(seconds=60)), START - timedelta(hours=1))
        write(rb, "static-one", schedule(timedelta(seconds=60)), last)
        import redis

        redis.Redis.from_url(services.REDIS_URL).sadd(f"{prefix}:statics", "static-one")
        c = our_cluster(prefix, exactonce_window_lookback=300)

        # A dry run says what would be imported, and writes nothing
        dry = run(c.app, "--dry-run")
        assert dry["dry_run"] is True and c.store.read_entries() == (0, {})
        rows = {row["entry"]: row for row in dry["entries"]}
        assert {n for n, r in rows.items() if r["imported"]} == {
            "every-5s",
            "cron-5m",
            "disabled",
            "never-run",
            "long-stopped",
        }
        assert "beat_schedule has it" in rows["static-one"]["why"]

        # The import stores each as RedBeat had it, paused where it was disabled
        done = run(c.app)
        stored = entries.list_stored(c.app)
        assert set(stored) == {n for n, r in rows.items() if r["imported"]}
        e = stored["every-5s"]
        assert isinstance(e, entries.StoredEntry)
        assert (e.task, e.schedule, e.args, e.kwargs) == (
            "plain.t",
            {"every": 5.0},
            [1],
            {"k": "v"},
        )
        assert stored["cron-5m"].schedule == {"cron": "*/5 * * * *", "tz": None}  # type: ignore[union-attr]
        assert stored["disabled"].paused is True  # type: ignore[union-attr]
        assert stored["never-run"].options == {"queue": "q"}  # type: ignore[union-attr]
        # The slots of an entry stopped longer than the look-back are counted, not lost
        long = {r["entry"]: r for r in done["entries"]}["long-stopped"]
        assert long["missed_older_than_lookback"] == 55  # 11:01 .. 11:55
        assert [(s.entry, s.where, s.count) for s in c.store.skipped()] == [
            ("long-stopped", "import", 55)
        ]

        # Then our beats run each from its next slot: RedBeat's last slot never again
        c.tick_all()
        c.run_until(START + timedelta(seconds=20), step=1, rotate=True)
        fired = Counter((job.entry, job.fire_time) for job in c.broker.sent)
        assert [key for key, n in fired.items() if n > 1] == []
        assert c.fired("every-5s") == [START + timedelta(seconds=s) for s in (0, 5, 10, 15, 20)]
        assert c.fired("cron-5m") == [START]
        assert c.fired("disabled") == []
        # never run: due at the import, as RedBeat has it
        assert c.fired("never-run") == [START + timedelta(seconds=s) for s in (0, 10, 20)]
        # the newest slot of the look-back is the catch-up's (latest); the older ones skipped
        assert c.fired("long-stopped") == [START]


def test_what_cannot_be_imported_is_named_and_the_rest_is_imported(prefix: str) -> None:
    import redis
    from redbeat import RedBeatSchedulerEntry
    from redbeat.schedules import rrule

    with isolated():
        rb = redbeat_app(prefix)
        write(rb, "good", schedule(timedelta(seconds=5)), None)
        write(rb, "halves", crontab(minute=[0, 30]), None)
        write(rb, "rrule", rrule("MINUTELY", dtstart=START), None)
        write(rb, "bad-zone", schedule(timedelta(seconds=5)), None)
        write(rb, "gone-static", schedule(timedelta(seconds=5)), None)
        write(rb, "celery.backend_cleanup", crontab(minute="0", hour="4"), None)
        RedBeatSchedulerEntry("unknown-task", "nobody.has.it", 5, app=rb).save()
        client = redis.Redis.from_url(services.REDIS_URL)
        client.sadd(f"{prefix}:statics", "gone-static", "celery.backend_cleanup")
        meta = {
            "last_run_at": {
                "__type__": "datetime",
                "year": 2026,
                "month": 1,
                "day": 1,
                "hour": 0,
                "minute": 0,
                "second": 0,
                "microsecond": 0,
                "timezone": "Nowhere/Atlantis",
            }
        }
        client.hset(f"{prefix}bad-zone", "meta", json.dumps(meta))
        c = our_cluster(prefix)
        entries.save(c.app, "good", "plain.t", 60)  # stored already: the import replaces it
        rows = {row["entry"]: row for row in run(c.app)["entries"]}
        assert (rows["good"]["imported"], rows["good"]["replaces"]) == (True, True)
        assert rows["halves"]["schedule"] == {"cron": "0,30 * * * *", "tz": None}
        assert "rrule schedule has no equal" in rows["rrule"]["why"]
        assert "not registered" in rows["unknown-task"]["why"]
        assert "unreadable" in rows["bad-zone"]["why"] and "Atlantis" in rows["bad-zone"]["why"]
        assert "no longer in beat_schedule" in rows["gone-static"]["why"]
        assert rows["celery.backend_cleanup"]["imported"] is True  # ours does not install it
        assert set(entries.list_stored(c.app)) == {"good", "halves", "celery.backend_cleanup"}
