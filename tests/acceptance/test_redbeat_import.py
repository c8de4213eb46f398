"""From a running RedBeat to three of our beats: ``exactonce import redbeat`` across the switch.

A real RedBeat beat (``celery beat -S redbeat.RedBeatScheduler``, RedBeat as
installed from the registry) runs 50 entries for two minutes: 40 from
``beat_schedule`` and 10 saved at run time (``RedBeatSchedulerEntry.save()``),
5 of those disabled, all every five seconds, on a worker that records each
run. It is stopped; ``import redbeat --dry-run`` changes nothing; ``import
redbeat`` stores the ten run-time entries (the forty stay in
``beat_schedule``); three ``celery beat -S exactonce`` nodes run on. Then:

* no entry ran a slot at or before the last one RedBeat ran (its
  ``last_run_at``), and none ran a slot twice;
* the disabled entries ran nothing, before or after;
* every slot of every enabled entry from the switch on ran once, and each
  slot that fell due between RedBeat's last run and the first claim of ours
  either ran (the catch-up policy) or is counted as skipped.

Minutes long: ``tox -e chaos``.
"""

from __future__ import annotations

import json
from collections import Counter
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from tests.acceptance import beats as b
from tests.acceptance.harness import BeatProcess, Deployment, Ledger, poll

EVERY = 5
STATIC, RUNTIME, DISABLED = 40, 10, 5
REDBEAT_SECONDS, OURS_SECONDS = 120, 40
END_MARGIN = 3

pytest.importorskip("redbeat")


class RedBeatProcess(BeatProcess):
    """RedBeat's own beat, on the ledger app."""

    @property
    def argv(self) -> list[str]:
        return self.celery(
            "beat", "-S", "redbeat.RedBeatScheduler", "-s", str(self.schedule_path), "-l", "INFO"
        )


def settings(prefix: str, broker_url: str) -> dict[str, Any]:
    """What the RedBeat beat, our beats and the worker share: 40 plain entries, RedBeat's keys."""
    schedule = {
        f"st-{i:02}": {"task": "plain_beat", "schedule": EVERY, "args": [f"st-{i:02}"]}
        for i in range(STATIC)
    }
    return {
        "beat_schedule": schedule,
        "redbeat_redis_url": broker_url,
        "redbeat_key_prefix": prefix,
        "exactonce_window_lookback": 60,
    }


def cli(deployment: Deployment, *args: str) -> Any:
    """The command's ``--json`` answer."""
    return json.loads(deployment.exactonce(*args, "--json").stdout)


def runs_by_redbeat(ledger: Ledger) -> dict[str, list[float]]:
    """Each entry's run times under RedBeat (its messages carry no occurrence)."""
    found: dict[str, list[float]] = {}
    for row in ledger.rows(task="plain_beat", phase="run"):
        if row.occurrence is None:
            found.setdefault(row.args[0], []).append(row.at)
    return found


def run_redbeat(deployment: Deployment, prefix: str) -> None:
    """Save the run-time entries, run RedBeat's beat for :data:`REDBEAT_SECONDS`, stop it."""
    from celery import Celery
    from redbeat import RedBeatSchedulerEntry

    app = Celery("redbeat-side", set_as_current=False)
    app.conf.update(redbeat_redis_url=deployment.broker_url, redbeat_key_prefix=prefix)
    for i in range(RUNTIME):
        enabled = i < RUNTIME - DISABLED
        RedBeatSchedulerEntry(
            f"rt-{i}", "plain_beat", EVERY, args=[f"rt-{i}"], enabled=enabled, app=app
        ).save()
    theirs = RedBeatProcess(deployment.env, deployment.tmp_path, "redbeat")
    deployment.beats.append(theirs)
    theirs.start()
    poll(lambda: "Starting" in theirs.log(), timeout=60, interval=0.2)
    b.run_until(deployment, b.store_now(deployment) + timedelta(seconds=REDBEAT_SECONDS), [theirs])
    assert theirs.proc is not None
    theirs.proc.terminate()
    theirs.proc.wait(timeout=30)
    poll(lambda: queue_empty(deployment), timeout=30, interval=0.2)  # its messages taken


def queue_empty(deployment: Deployment) -> bool:
    """Whether the queue holds no message (on Redis an empty queue has no key at all)."""
    from kombu.exceptions import ChannelError

    try:
        return deployment.waiting() == 0
    except ChannelError:
        return True


def last_run_at(client: Any, prefix: str) -> dict[str, datetime]:
    """RedBeat's ``last_run_at`` of each entry, as its ``meta`` holds it."""
    from redbeat.decoder import RedBeatJSONDecoder

    found = {}
    for key in client.scan_iter(match=f"{prefix}*"):
        name = key.decode()[len(prefix) :]
        if name.startswith(":"):
            continue
        meta = client.hget(key, "meta")
        if meta:
            last = json.loads(meta, cls=RedBeatJSONDecoder).get("last_run_at")
            if last is not None:
                found[name] = last.astimezone(timezone.utc)
    return found


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis",))
def test_redbeat_entries_imported_run_on_our_beats_with_no_slot_twice(
    deployment: Deployment, ledger: Ledger
) -> None:
    import redis

    prefix = f"rb-{deployment.uid}:"
    conf = settings(prefix, deployment.broker_url)
    deployment.extra_env["EXACTONCE_ACC_EXTRA_CONF"] = json.dumps(conf)
    client = redis.Redis.from_url(deployment.broker_url)
    deployment.start_worker(concurrency=4)

    # Given RedBeat running 40 static entries and 10 saved at run time, 5 of them disabled
    run_redbeat(deployment, prefix)
    before = runs_by_redbeat(ledger)
    stopped = last_run_at(client, prefix)
    assert set(before) == {f"st-{i:02}" for i in range(STATIC)} | {
        f"rt-{i}" for i in range(RUNTIME - DISABLED)
    }, "RedBeat did not run every enabled entry"

    # When a dry run, then the import, then three of our beats
    dry = cli(deployment, "import", "redbeat", "--dry-run")
    assert deployment.store().read_entries() == (0, {})
    rows = {row["entry"]: row for row in dry["entries"]}
    imported = {n for n, r in rows.items() if r["imported"]} - {"celery.backend_cleanup"}
    assert imported == {f"rt-{i}" for i in range(RUNTIME)}  # and Celery's own, if installed
    assert all("beat_schedule has it" in rows[f"st-{i:02}"]["why"] for i in range(STATIC))
    cli(deployment, "import", "redbeat")
    ours = b.start_beats(deployment, [{}, {}, {}], entries=0, every=0)
    started = b.store_now(deployment)
    b.run_until(deployment, started + timedelta(seconds=OURS_SECONDS), ours)
    for beat in ours:
        beat.kill()
    window_end = b.store_now(deployment) - timedelta(seconds=END_MARGIN)

    # Then no slot ran twice, and none at or before RedBeat's last run of its entry
    b.wait_executed(ledger, set())
    runs = Counter(row.occurrence for row in ledger.rows(task="plain_beat", phase="run"))
    runs.pop(None, None)
    assert [occ for occ, n in runs.items() if n > 1] == []
    early = [(n, f) for n, f in runs if n in stopped and f <= stopped[n]]
    assert early == [], f"slots at or before RedBeat's last run: {early[:3]}"
    # And the disabled ones ran nothing, anywhere
    disabled = {f"rt-{i}" for i in range(RUNTIME - DISABLED, RUNTIME)}
    assert not disabled & set(before) and not [n for n, _ in runs if n in disabled]
    # And every slot of every enabled entry after the switch ran, once; the ones between
    # RedBeat's last run and our first claims ran or were counted as skipped
    skipped = b.skipped_slots(ours, deployment)
    floor = b.claim_floor(deployment)
    tally: Counter[str] = Counter()
    for name in before:
        grid = [
            datetime.fromtimestamp(t, timezone.utc)
            for t in range(
                (int(stopped[name].timestamp()) // EVERY + 1) * EVERY,
                int(window_end.timestamp()) + 1,
                EVERY,
            )
        ]
        ran = {f for n, f in runs if n == name}
        for fire in grid:
            settled = fire in ran or (name, fire) in skipped
            assert settled, f"{name} @ {fire}: neither ran nor counted (floor {floor})"
            tally["ran" if fire in ran else "counted"] += 1
        late = [f for f in grid if f > started + timedelta(seconds=5)]
        assert set(late) <= ran, f"{name}: slots after the switch never ran"
    print(
        f"RedBeat ran {sum(len(v) for v in before.values())} times; after its last run of each"
        f" entry, {tally['ran']} slots ran on ours and {tally['counted']} were counted skipped"
    )
