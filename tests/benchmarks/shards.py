"""Beat's claims on a three-master Redis Cluster: a namespace on one shard against three.

``tox -e bench -- --suite shards`` (or ``python -m tests.benchmarks.shards``
alone) starts a Redis Cluster of three masters, no replicas
(tests/integration/redis_server.py; killed by pid at the end), then, for
``exactonce_shards`` 1 and 3, runs ``P`` claiming processes at once, each
claiming its own ``N`` fresh occurrences (distinct entries) in beat's batches
under the store epoch. With one shard the namespace is one slot on one
master; with three it is a slot on each master. Two figures per layout:

* **claims/s**: all the processes' claims per second, from a start they share;
* **store ceiling**: claims per CPU second of the *busiest* master (its
  ``/proc/<pid>/stat`` time during the run), the rate at which that master
  would be saturated: what the store can take, whoever sends it.

On one machine the masters share its cores with the Python clients. On a
2-core machine the clients saturate the cores long before the masters do
(a master is about a tenth busy), so the claims/s cannot tell the layouts
apart there; the ceiling does, and it is the figure a cluster of separate
machines, each master on cores of its own, scales by.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from celery_exactonce.beat import claims
from celery_exactonce.beat.claimer import CLAIM_BATCH
from celery_exactonce.stores import store_from_url
from tests.benchmarks.claims import occurrences

#: The layouts compared: every shard on one master, and a shard on each.
LAYOUTS = (1, 3)


@dataclass(frozen=True)
class Run:
    """One run of one layout: claims per second, and per CPU second of the busiest master."""

    rate: float
    ceiling: float


def _claimer(url: str, shards: int, namespace: str, index: int, count: int, start: Any) -> None:
    store = store_from_url(url, namespace=namespace, shards=shards)
    try:
        store.setup()
        epoch = store.epoch()
        now = store.now()
        fire = now.replace(microsecond=0) - timedelta(seconds=1)
        jobs = [
            j
            for j in occurrences(store, count * (index + 1), fire)[count * index :]
            if j.entry is not None
        ]
        start.wait()
        for i in range(0, len(jobs), CLAIM_BATCH):
            batch = jobs[i : i + CLAIM_BATCH]
            got = claims.claim(store, batch, epoch=epoch, now=now)
            if len(got.won) != len(batch):
                raise AssertionError(f"won {len(got.won)} of {len(batch)}")
    finally:
        store.close()


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds process ``pid`` has used (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(url: str, shards: int, processes: int, count: int, masters: list[int]) -> Run:
    """``processes`` claiming ``count`` each, the namespace over ``shards``; ``masters``: pids."""
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(processes + 1)
    namespace = f"bench-shards-{shards}-{time.monotonic_ns()}"
    workers = [
        context.Process(target=_claimer, args=(url, shards, namespace, i, count, start))
        for i in range(processes)
    ]
    for worker in workers:
        worker.start()
    start.wait()
    before = [cpu_seconds(pid) for pid in masters]
    began = time.perf_counter()
    for worker in workers:
        worker.join(600)
        if worker.exitcode != 0:
            raise RuntimeError(f"a claiming process ended with {worker.exitcode}")
    elapsed = time.perf_counter() - began
    busiest = max(cpu_seconds(pid) - b for pid, b in zip(masters, before, strict=True))
    cleanup = store_from_url(url, namespace=namespace, shards=shards)
    try:
        cleanup.drop_namespace()  # type: ignore[attr-defined]
    finally:
        cleanup.close()
    total = processes * count
    # A master's CPU time ticks in 1/100 s: a run too short to tick reads as one tick.
    return Run(total / elapsed, total / max(busiest, 1 / os.sysconf("SC_CLK_TCK")))


def run(processes: int, count: int, runs: int) -> dict[int, Run]:
    """The best of ``runs`` runs of each layout (:data:`LAYOUTS`), on a cluster of its own."""
    from tests.integration.redis_server import cluster

    best: dict[int, Run] = {}
    with cluster(masters=3, replicas_per_master=0) as group:
        url = group.url()
        masters = [s.pid for s in group.servers if s.pid is not None]
        for _ in range(runs):
            for shards in LAYOUTS:
                got = measure(url, shards, processes, count, masters)
                old = best.get(shards, Run(0.0, 0.0))
                best[shards] = Run(max(old.rate, got.rate), max(old.ceiling, got.ceiling))
    return best


def report(best: dict[int, Run], processes: int, count: int, runs: int) -> list[str]:
    """The table: each layout's claims/s and store ceiling, and the ratios of 3 to 1."""
    lines = [
        f"\nbeat's claims on a 3-master Redis Cluster, {processes} processes x {count:,} "
        f"claims, best of {runs}\n",
        f"{'layout':<22}{'claims/s':>14}{'store ceiling':>18}",
    ]
    lines += [
        f"{f'exactonce_shards={shards}':<22}{r.rate:>14,.0f}{r.ceiling:>18,.0f}"
        for shards, r in best.items()
    ]
    one, three = best[1], best[3]
    lines += [
        f"{'ratio 3 / 1':<22}{three.rate / one.rate:>13.2f}x{three.ceiling / one.ceiling:>17.2f}x",
        "(store ceiling: claims per CPU second of the busiest master; claims/s is bound by "
        "the clients' cores on a small machine)",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.shards")
    parser.add_argument("--processes", type=int, default=6, help="claiming processes")
    parser.add_argument("--claims", type=int, default=5000, help="claims per process")
    parser.add_argument("--runs", type=int, default=2, help="runs of each layout (best kept)")
    args = parser.parse_args(argv)
    best = run(args.processes, args.claims, args.runs)
    print("\n".join(report(best, args.processes, args.claims, args.runs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
