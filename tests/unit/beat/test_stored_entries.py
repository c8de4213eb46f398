"""Stored beat entries (celery_exactonce.entries) on a cluster of beat nodes, one store.

Saved, re-timed, paused, resumed and removed while three nodes tick: each
node takes the change at its next tick, every slot is dispatched once, a
removed or paused entry fires nothing, and no slot before a change fires
under the new definition.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest
from celery.schedules import crontab, solar

from celery_exactonce import ConfigurationError, entries, runtime
from celery_exactonce.beat import stored
from celery_exactonce.core import times
from celery_exactonce.observe import metrics
from celery_exactonce.schedules import at, cron
from celery_exactonce.stores.signing import Signer, SigningStore
from tests.support.beat_cluster import (
    START,
    Cluster,
    every,
    isolated,
    refused_at_start,
    register_plain_tasks,
)


@pytest.fixture(autouse=True)
def _isolated() -> Iterator[None]:
    with isolated():
        yield


def cluster(nodes: int = 3, schedule: dict | None = None, **conf: object) -> Cluster:  # type: ignore[type-arg]
    made = Cluster(schedule or {"fixed": every(60)}, nodes=nodes, **conf)
    register_plain_tasks(made.app, {"stored": {"task": "plain.s"}})
    return made


def duplicates(c: Cluster) -> list[tuple[str, datetime]]:
    counted = Counter((job.entry, job.fire_time) for job in c.broker.sent)
    return [key for key, n in counted.items() if n > 1]  # type: ignore[misc]


def grid(start: datetime, end: datetime, seconds: int) -> list[datetime]:
    """The slots of an every-``seconds`` interval in ``[start, end]``."""
    first = start + timedelta(seconds=-start.timestamp() % seconds)
    return [
        first + timedelta(seconds=seconds * i)
        for i in range(int((end - first).total_seconds()) // seconds + 1)
    ]


def test_a_saved_entry_runs_on_every_node_from_its_save_each_slot_once() -> None:
    c = cluster()
    c.tick_all()
    c.run_until(START + timedelta(seconds=25), step=1, rotate=True)
    saved_at = c.clock.now()
    entries.save(c.app, "report", "plain.s", 10, kwargs={"day": "mon"}, options={"queue": "q"})
    # Every node runs it from its next tick
    c.tick_all()
    assert all("report" in node.schedule for node in c.nodes)
    c.run_until(START + timedelta(seconds=60), step=1, rotate=True)
    # From the save on (no slot before it caught up), each slot once, as saved
    assert c.fired("report") == grid(saved_at, START + timedelta(seconds=60), 10)
    assert duplicates(c) == []
    job = next(job for job in c.broker.sent if job.entry == "report")
    assert (job.kwargs, job.options["queue"]) == ({"day": "mon"}, "q")


def test_a_re_timed_entry_fires_its_new_slots_from_the_change_and_no_past_one() -> None:
    c = cluster()
    entries.save(c.app, "report", "plain.s", 10)
    c.tick_all()
    c.run_until(START + timedelta(seconds=33), step=1, rotate=True)
    before = list(c.fired("report"))
    changed_at = c.clock.now()
    entries.save(c.app, "report", "plain.s", cron("* * * * *"))
    c.run_until(START + timedelta(seconds=185), step=1, rotate=True)
    after = [fire for fire in c.fired("report") if fire not in before]
    assert after == [START + timedelta(minutes=m) for m in (1, 2, 3)]
    assert all(fire > changed_at for fire in after)
    assert duplicates(c) == []


def test_new_arguments_keep_the_entrys_slots() -> None:
    c = cluster(nodes=2)
    entries.save(c.app, "report", "plain.s", 10, args=[1])
    first = entries.get(c.app, "report")
    c.tick_all()
    c.run_until(START + timedelta(seconds=15), step=1)
    again = entries.save(c.app, "report", "plain.s", 10, args=[2])
    assert first is not None and again.since == first.since
    c.run_until(START + timedelta(seconds=30), step=1)
    assert [job.args for job in c.broker.sent if job.entry == "report"] == [[1], [1], [2], [2]]


def test_a_paused_entry_fires_nothing_and_resumed_does_not_catch_up() -> None:
    c = cluster(exactonce_catchup="all")
    entries.save(c.app, "report", "plain.s", 10)
    c.tick_all()
    c.run_until(START + timedelta(seconds=12), step=1, rotate=True)
    assert entries.pause(c.app, "report").paused
    c.run_until(START + timedelta(seconds=45), step=1, rotate=True)
    assert c.fired("report") == [START, START + timedelta(seconds=10)]
    assert not any("report" in node.schedule for node in c.nodes)
    resumed_at = c.clock.now()
    entries.resume(c.app, "report")
    c.run_until(START + timedelta(seconds=70), step=1, rotate=True)
    assert c.fired("report")[2:] == grid(resumed_at, START + timedelta(seconds=70), 10)
    assert duplicates(c) == []


def test_a_removed_entry_fires_no_more_and_saved_again_never_repeats_a_slot() -> None:
    c = cluster()
    entries.save(c.app, "report", "plain.s", 10)
    c.tick_all()
    c.run_until(START + timedelta(seconds=21), step=1, rotate=True)
    assert entries.delete(c.app, "report") is True
    assert entries.delete(c.app, "report") is False
    c.run_until(START + timedelta(seconds=50), step=1, rotate=True)
    assert c.fired("report") == [START + timedelta(seconds=s) for s in (0, 10, 20)]
    assert not any("report" in node.schedule for node in c.nodes)
    # Written again with a start before its claimed slots: none of those fires again
    c.store.write_entry("report", _definition(START))
    c.run_until(START + timedelta(seconds=70), step=1, rotate=True)
    assert duplicates(c) == []
    again = c.fired("report")[3:]
    assert again and all(fire > START + timedelta(seconds=20) for fire in again)


def _definition(since: datetime, schedule: dict | None = None) -> str:  # type: ignore[type-arg]
    return stored.encode(
        {
            "task": "plain.s",
            "schedule": schedule or {"every": 10.0},
            "args": [],
            "kwargs": {},
            "options": {},
            "paused": False,
            "since": times.to_micros(since),
        }
    )


def test_a_name_of_beat_schedule_is_refused_by_save_and_at_beat_start() -> None:
    c = cluster(nodes=1)
    with pytest.raises(ConfigurationError, match=r"'fixed'.*beat_schedule"):
        entries.save(c.app, "fixed", "plain.s", 10)
    assert c.store.read_entries() == (0, {})
    c.store.write_entry("fixed", _definition(START))
    with refused_at_start(r"stored entries \['fixed'\] have the names of beat_schedule"):
        c.add_node({"fixed": every(60)})


def test_bad_input_is_refused_naming_the_entry_and_stores_nothing() -> None:
    c = cluster(nodes=1)
    entries.save(c.app, "kept", "plain.s", 10)
    kept = c.store.read_entries()
    cases = [
        ({"name": "", "schedule": 10}, "entry name must not be empty"),
        ({"name": "x", "schedule": "61 * * * *"}, "'x'.*61"),
        ({"name": "x", "schedule": object()}, "'x'.*schedule"),
        ({"name": "x", "schedule": -5}, "'x'.*above 0"),
        ({"name": "x", "schedule": 10, "kwargs": {"when": object()}}, "'x'.*kwargs"),
        ({"name": "x", "schedule": 10, "task": "nobody.has.it"}, "'x'.*not registered"),
        (
            {"name": "x", "schedule": 10, "options": {"exactonce": {"catchup": "bad"}}},
            "'x'.*catchup",
        ),
    ]
    for fields, match in cases:
        args = {"task": "plain.s", **fields}
        with pytest.raises(ConfigurationError, match=match):
            entries.save(c.app, args.pop("name"), args.pop("task"), args.pop("schedule"), **args)
    assert c.store.read_entries() == kept
    with pytest.raises(KeyError, match="'nope'"):
        entries.pause(c.app, "nope")


def test_a_definition_beat_cannot_run_is_refused_alone(caplog: pytest.LogCaptureFixture) -> None:
    c = cluster(nodes=2)
    entries.save(c.app, "good", "plain.s", 10)
    c.store.write_entry("not-json", "{")
    c.store.write_entry("newer", json.dumps({"v": 99}))
    c.store.write_entry("bad-cron", _definition(START, {"cron": "x"}))
    with caplog.at_level(logging.ERROR, logger="celery_exactonce"):
        c.tick_all()
        c.run_until(START + timedelta(seconds=20), step=1)
    assert len(c.fired("good")) == 3
    refused = [
        r.getMessage() for r in caplog.records if getattr(r, "action", "") == "entry_refused"
    ]
    assert len(refused) == 6  # three entries, once per node
    assert any("stored entry 'newer'" in m and "format 99" in m for m in refused)
    assert any("stored entry 'not-json'" in m for m in refused)
    assert any("stored entry 'bad-cron'" in m for m in refused)
    assert metrics.COUNTERS.get("entry_refused") == 6


def test_schedules_read_back_as_saved() -> None:
    zone = "Europe/Berlin"
    cases = {
        "every": (timedelta(minutes=5), {"every": 300.0}),
        "cron": ("*/5 * * * *", {"cron": "*/5 * * * *", "tz": None}),
        "cron-zone": (cron("0 3 * * *", tz=zone), {"cron": "0 3 * * *", "tz": zone}),
        "crontab": (crontab(minute="0", hour="*/2"), {"cron": "0 */2 * * *", "tz": None}),
        "at": (at(START), {"at": times.to_micros(START)}),
        "solar": (solar("sunrise", 52.5, 13.4), {"solar": "sunrise", "lat": 52.5, "lon": 13.4}),
    }
    for name, (schedule, encoded) in cases.items():
        assert stored.encode_schedule(schedule) == encoded, name
        decoded = stored.decode_schedule(name, encoded)
        assert stored.encode_schedule(decoded) == encoded, name


def test_signed_entries_verify_and_a_forged_one_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    c = cluster(nodes=1, exactonce_signing_key="k" * 32)
    signing = SigningStore(c.store, Signer("k" * 32))
    runtime.runtime_for(c.app).store = signing
    c.nodes[0]._runtime.store = signing
    entries.save(c.app, "good", "plain.s", 10)
    assert "signature" in c.store.read_entries()[1]["good"]
    c.store.write_entry("forged", _definition(START))  # written around the signer
    with caplog.at_level(logging.ERROR, logger="celery_exactonce"):
        c.tick_all()
        c.run_until(START + timedelta(seconds=10), step=1)
    assert len(c.fired("good")) == 2 and c.fired("forged") == []
    assert any(
        "'forged'" in r.getMessage() and "not signed" in r.getMessage() for r in caplog.records
    )


def test_scenario_73_shape_two_hundred_stored_entries_edited_while_three_nodes_run() -> None:
    # SCENARIOS 73 on stored entries: edits apply on every node within a tick, past
    # slots never re-fire, every slot once
    c = cluster()
    for i in range(200):
        entries.save(c.app, f"e-{i:03}", "plain.s", 10)
    c.tick_all()
    c.run_until(START + timedelta(seconds=60), step=1, rotate=True)
    edited_at = c.clock.now()
    for i in range(200):
        if i % 4 == 0:
            entries.pause(c.app, f"e-{i:03}")
        elif i % 4 == 1:
            entries.delete(c.app, f"e-{i:03}")
        elif i % 4 == 2:
            entries.save(c.app, f"e-{i:03}", "plain.s", 15)
    sent_before = len(c.broker.sent)
    c.run_until(edited_at + timedelta(seconds=1), step=1, rotate=True)
    for node in c.nodes:
        running = {name for name in node.schedule if name.startswith("e-")}
        assert running == {f"e-{i:03}" for i in range(200) if i % 4 in (2, 3)}
    c.run_until(edited_at + timedelta(seconds=60), step=1, rotate=True)
    after = c.broker.sent[sent_before:]
    assert duplicates(c) == []
    by_kind: dict[int, set[datetime]] = {}
    for job in (job for job in after if job.entry != "fixed"):
        by_kind.setdefault(int(job.entry.rsplit("-", 1)[1]) % 4, set()).add(job.fire_time)  # type: ignore[union-attr]
    assert set(by_kind) == {2, 3}
    assert all(f > edited_at and f.timestamp() % 15 == 0 for f in by_kind[2])
    assert all(f.timestamp() % 10 == 0 for f in by_kind[3])
    # Each kept entry fired every slot of the minute after the edit
    for i in (2, 3, 198, 199):
        fires = [f for f in c.fired(f"e-{i:03}") if f > edited_at]
        expected = grid(
            edited_at + timedelta(seconds=1),
            edited_at + timedelta(seconds=60),
            15 if i % 4 == 2 else 10,
        )
        assert fires == expected, i


def test_a_save_keeps_the_pause_and_a_pause_keeps_a_save_made_meanwhile() -> None:
    c = cluster(nodes=1)
    entries.save(c.app, "report", "plain.s", 10, args=[1])
    entries.pause(c.app, "report")
    # new arguments for a paused entry: still paused
    assert entries.save(c.app, "report", "plain.s", 10, args=[2]).paused is True
    entries.resume(c.app, "report")
    # a pause whose first write finds the entry changed under it reads again
    store, write = c.store, c.store.write_entry
    raced: list[str] = []

    def first_write_loses(name: str, text: str | None, **kw: object) -> int | None:
        if not raced:  # another writer saves new arguments just before this write lands
            raced.append(name)
            entries.save(c.app, "report", "plain.s", 10, args=[3], paused=False)
        return write(name, text, **kw)  # type: ignore[arg-type]

    store.write_entry = first_write_loses  # type: ignore[method-assign]
    paused = entries.pause(c.app, "report")
    assert (paused.paused, paused.args) == (True, [3])
    stored = entries.get(c.app, "report")
    assert stored is not None and (stored.paused, stored.args) == (True, [3])


def test_an_entry_beat_refuses_can_be_removed_and_is_named_by_pause() -> None:
    c = cluster(nodes=1)
    c.store.write_entry("broken", "{")
    with pytest.raises(ConfigurationError, match="'broken'"):
        entries.pause(c.app, "broken")
    assert entries.delete(c.app, "broken") is True
    assert c.store.read_entries()[1] == {}


def test_values_of_the_wrong_kind_and_a_past_instant_are_refused() -> None:
    c = cluster(nodes=1)
    cases = [
        ({"args": "hello"}, "args must be a list"),
        ({"kwargs": ["a"]}, "kwargs must be a mapping"),
        ({"paused": "false"}, "paused must be True or False"),
        ({"schedule": at(START - timedelta(seconds=1))}, "is past"),
    ]
    for fields, match in cases:
        spec = {"name": "x", "task": "plain.s", "schedule": 10, **fields}
        with pytest.raises(ConfigurationError, match=match):
            entries.save_many(c.app, [spec])
    assert c.store.read_entries() == (0, {})
    # a crontab of lists, as Celery takes it
    saved = entries.save(c.app, "halves", "plain.s", crontab(minute=[0, 30], hour="*/2"))
    assert saved.schedule == {"cron": "0,30 */2 * * *", "tz": None}


def test_a_revision_that_goes_back_is_said_and_a_full_read_comes_every_five_minutes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    c = cluster(nodes=1)
    entries.save(c.app, "a", "plain.s", 10)
    entries.save(c.app, "b", "plain.s", 10)
    c.tick_all()
    node = c.nodes[0]
    assert {"a", "b"} <= set(node.schedule)
    # The store loses its last write, then counts to the same revision with other content
    c.store._entries.pop("b")  # type: ignore[attr-defined]
    c.store._entries_revision -= 1  # type: ignore[attr-defined]
    with caplog.at_level(logging.ERROR, logger="celery_exactonce"):
        c.run(2)
    assert "b" not in node.schedule
    assert [r for r in caplog.records if getattr(r, "action", "") == "stored_entries_lost"]
    c.store._entries["c"] = c.store._entries["a"]  # type: ignore[attr-defined]  # same revision
    c.run(10)
    assert "c" not in node.schedule  # the revision did not move
    c.run(stored.FULL_READ_INTERVAL)
    assert "c" in node.schedule  # the five-minute read finds it


def test_resign_signs_every_entry_with_the_first_key() -> None:
    c = cluster(nodes=1, exactonce_signing_key=["o" * 32])
    signing = SigningStore(c.store, Signer("o" * 32))
    runtime.runtime_for(c.app).store = signing
    entries.save(c.app, "a", "plain.s", 10)
    signing.signer = Signer(["n" * 32, "o" * 32])  # the rotation's second step
    assert entries.resign(c.app) == ["a"]
    signing.signer = Signer("n" * 32)  # the old key dropped
    assert isinstance(entries.list_stored(c.app)["a"], entries.StoredEntry)
