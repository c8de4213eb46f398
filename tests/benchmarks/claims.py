"""Beat's claim on each store: slots claimed per second by one client, won and lost.

What bounds a cluster of beat nodes is the store's claim throughput: every
node claims every due slot (:func:`claims.claim`, ``create_many`` in batches
of :data:`~celery_exactonce.beat.claimer.CLAIM_BATCH` under the store epoch), one
wins it and the others find it taken. So per store this measures, from one
client, with no concurrency:

* **won**: claims of fresh occurrences (each creates a record and advances its
  entry's watermark);
* **lost**: the same claims again (each finds the record: what every node but
  one pays for each slot).

Occurrence jobs are built as beat builds them, outside the timing. The figures
feed ``docs/design/scale.md``.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta

from celery_exactonce.beat import claims
from celery_exactonce.beat.claimer import CLAIM_BATCH
from celery_exactonce.beat.entries import occurrence_id
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.stores.base import StateStore


def occurrences(store: StateStore, count: int, fire: datetime) -> list[NewJob]:
    """``count`` occurrences of distinct entries at ``fire``, as beat claims them."""
    return [
        NewJob(
            JobRef.occurrence(occurrence_id(store.namespace, f"c{i:06}", fire)),
            "bench.t",
            State.SCHEDULED,
            node="bench",
            args=[i],
            options={"exactonce_gated": False},
            entry=f"c{i:06}",
            fire_time=fire,
            reason="beat claim",
        )
        for i in range(count)
    ]


def measure(store: StateStore, count: int) -> dict[str, float]:
    """Claims per second, won and lost, batches of ``CLAIM_BATCH``."""
    epoch = store.epoch()
    now = store.now()
    fire = now.replace(microsecond=0) - timedelta(seconds=1)
    figures = {}
    # The second pass is another node's claims of the same slots (its own revs): all taken.
    for name, expect in (("won", "won"), ("lost", "taken")):
        jobs = occurrences(store, count, fire)
        start = time.perf_counter()
        for i in range(0, count, CLAIM_BATCH):
            batch = jobs[i : i + CLAIM_BATCH]
            got = claims.claim(store, batch, epoch=epoch, now=now)
            if len(getattr(got, expect)) != len(batch):
                raise AssertionError(f"{name}: {len(getattr(got, expect))} of {len(batch)}")
        figures[f"claims/s, {name}"] = count / (time.perf_counter() - start)
    return figures
