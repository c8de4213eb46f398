"""Many beat nodes on one store: run them over whole slots, and read back what they claimed.

Shared by ``test_beat_scale.py`` (10 nodes, 10,000 entries every minute, five
slots: no duplicate, no miss) and usable on its own for the claim rate against
the node count (``python -m tests.acceptance.beat_scale redis 1,2,5,10``).

No worker runs: the evidence is the store's record of each ``(entry,
fire_time)`` (its node, its dispatch count, when it was claimed, on the store's
clock) and the broker queue, which holds every message beat published (each
message's task id is its occurrence's id, so a duplicate publish shows as an id
twice).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

import redis

from celery_exactonce import ExactOnceConfig
from celery_exactonce.beat.entries import occurrence_id
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.states import State
from tests import services
from tests.acceptance import beats as b
from tests.acceptance.harness import Deployment, poll

#: Jobs read back per listing call.
LIST_LIMIT = 1_000_000


@dataclass
class Run:
    """What the nodes did over the measured slots."""

    nodes: int
    entries: int
    slots: list[datetime]
    expected: set[b.Occurrence]
    claimed: dict[b.Occurrence, Job]  # each occurrence of the window the store holds
    messages: Counter[str]  # task id -> messages on the broker queue
    won: Counter[str]  # node -> occurrences of the window it won

    def missing(self) -> set[b.Occurrence]:
        return self.expected - set(self.claimed)

    def duplicates(self) -> dict[str, int]:
        """Task ids published more than once (anywhere in the run), or dispatched twice."""
        twice = {task_id: n for task_id, n in self.messages.items() if n > 1}
        twice.update(
            {job.ref.id: job.dispatches for job in self.claimed.values() if job.dispatches > 1}
        )
        return twice

    def unpublished(self, namespace: str) -> set[b.Occurrence]:
        """Occurrences of the window whose message is not on the queue."""
        return {o for o in self.expected if self.messages[occurrence_id(namespace, *o)] == 0}

    def latencies(self) -> list[float]:
        """Per slot: seconds from the slot to its last claim (store time)."""
        last: dict[datetime, datetime] = {}
        for (_, fire), job in self.claimed.items():
            last[fire] = max(last.get(fire, job.created_at), job.created_at)
        return [(last[fire] - fire).total_seconds() for fire in self.slots if fire in last]

    def report(self) -> str:
        lat = self.latencies()
        rate = self.entries / statistics.median(lat) if lat else 0.0
        spread = sorted(self.won.values())
        return (
            f"{self.nodes} node(s), {self.entries:,} entries, {len(self.slots)} slots: "
            f"{len(self.claimed):,} of {len(self.expected):,} claimed, "
            f"{len(self.duplicates())} duplicate(s); slot to last claim: "
            f"median {statistics.median(lat) if lat else 0:.2f} s, max {max(lat, default=0):.2f} s "
            f"(claim rate about {rate:,.0f}/s); won by {len(self.won)} node(s), "
            f"{spread[0] if spread else 0:,} to {spread[-1] if spread else 0:,} each"
        )


def run(deployment: Deployment, *, nodes: int, entries: int, every: float, slots: int) -> Run:
    """Start ``nodes`` beats with ``entries`` entries every ``every`` seconds; measure ``slots``.

    The measured slots are the ``slots`` whole slots after every node started
    and the store-loss guard's floor. Returns once each of them is claimed and
    published, with the beats SIGKILLed; or once the last slot has left
    ``window_lookback`` (past it, a slot not yet claimed is skipped: a miss,
    which :class:`Run` reports).
    """
    if deployment.store_kind == "postgres":
        services.vacuum_postgres()  # the rows the runs before deleted
    from tests.acceptance.apps.ledger_app import LOG_LEVEL  # the app, imported where used

    # Beats log at INFO, as users run them: not a debug record per slot another node won.
    quiet = {LOG_LEVEL: "INFO"}
    beats = b.start_beats(deployment, [quiet] * nodes, entries=entries, every=every)
    floor = b.claim_floor(deployment)
    begin = max(b.store_now(deployment), floor) + timedelta(seconds=1)
    first = datetime.fromtimestamp((begin.timestamp() // every + 1) * every, timezone.utc)
    fires = [first + timedelta(seconds=every * k) for k in range(slots)]
    names = b.entry_names(entries)
    expected = {(name, fire) for name in names for fire in fires}
    b.run_until(deployment, fires[-1], beats)
    store = deployment.store()

    def decided() -> bool:
        marks = store.watermarks(names)
        return len(marks) == len(names) and min(marks.values()) >= fires[-1]

    # A slot is missed only once it leaves the window unclaimed: wait for up to that long.
    lookback = ExactOnceConfig.from_app(deployment.app()).window_lookback
    try:
        poll(decided, timeout=lookback, interval=1.0)
        poll(lambda: not _in_flight(deployment, fires), timeout=30, interval=1.0)
    except AssertionError:
        pass  # reported below: what is missing or unpublished
    for beat in beats:
        beat.kill()
    window = set(fires)
    claimed: dict[b.Occurrence, Job] = {}
    for state in (State.PUBLISHED, State.DISPATCHED, State.SCHEDULED):
        for job in store.list_stale(state, 0, LIST_LIMIT):
            if job.entry is not None and job.fire_time in window:
                claimed[(job.entry, job.fire_time)] = job
    won = Counter(job.node for job in claimed.values())
    return Run(nodes, entries, fires, expected, claimed, queue_ids(deployment), won)


def _in_flight(deployment: Deployment, fires: list[datetime]) -> bool:
    """Whether a claim of the window is not yet published (``SCHEDULED``/``DISPATCHED``)."""
    window = set(fires)
    store = deployment.store()
    return any(
        job.fire_time in window
        for state in (State.SCHEDULED, State.DISPATCHED)
        for job in store.list_stale(state, 0, LIST_LIMIT)
    )


def queue_ids(deployment: Deployment) -> Counter[str]:
    """The task id of every message on the deployment's Redis queue, counted."""
    client = redis.Redis.from_url(deployment.broker_url)
    key = f"{deployment.redis_prefix}{deployment.queue}"
    ids: Counter[str] = Counter()
    try:
        length = client.llen(key)
        for start in range(0, length, 5000):
            for raw in client.lrange(key, start, start + 4999):
                ids[json.loads(raw)["headers"]["id"]] += 1
    finally:
        client.close()
    return ids


def main(argv: list[str]) -> int:
    """``python -m tests.acceptance.beat_scale STORE NODES[,NODES…] [ENTRIES [EVERY [SLOTS]]]``."""
    store, counts = argv[0], [int(n) for n in argv[1].split(",")]
    entries = int(argv[2]) if len(argv) > 2 else 10_000
    every = float(argv[3]) if len(argv) > 3 else 60.0
    slots = int(argv[4]) if len(argv) > 4 else 2
    for nodes in counts:
        with tempfile.TemporaryDirectory() as tmp:
            deployment = Deployment("redis", store, Path(tmp))
            try:
                result = run(deployment, nodes=nodes, entries=entries, every=every, slots=slots)
                print(result.report(), flush=True)
            finally:
                deployment.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
