"""Beat's claims per second on a three-master Redis Cluster: one shard against three.

``python -m tests.benchmarks.shards [--processes P] [--claims N]`` starts a
Redis Cluster of three masters (tests/integration/redis_server.py; killed by
pid at the end), then, for ``exactonce_shards`` 1 and 3, runs ``P`` claiming
processes at once, each claiming its own ``N`` fresh occurrences (distinct
entries) in beat's batches under the store epoch. With one shard the
namespace is one slot on one master; with three it is over the three. The
figure is all the processes' claims per second, from a start they share.

Not part of ``--suite all``: it needs ``redis-server`` and ``redis-cli`` and
starts its own cluster. On one machine the masters share its cores with the
clients, so the figures show what the store layout allows there, not what
three machines would give.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from datetime import timedelta
from typing import Any

from celery_exactonce import claims
from celery_exactonce.claimer import CLAIM_BATCH
from celery_exactonce.stores import store_from_url
from tests.benchmarks.claims import occurrences


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


def measure(url: str, shards: int, processes: int, count: int) -> float:
    """All the processes' claims per second, ``count`` each, the namespace over ``shards``."""
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
    began = time.perf_counter()
    for worker in workers:
        worker.join(600)
        if worker.exitcode != 0:
            raise RuntimeError(f"a claiming process ended with {worker.exitcode}")
    elapsed = time.perf_counter() - began
    cleanup = store_from_url(url, namespace=namespace, shards=shards)
    try:
        cleanup.drop_namespace()  # type: ignore[attr-defined]
    finally:
        cleanup.close()
    return processes * count / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.shards")
    parser.add_argument("--processes", type=int, default=6, help="claiming processes")
    parser.add_argument("--claims", type=int, default=5000, help="claims per process")
    parser.add_argument("--runs", type=int, default=2, help="runs of each layout (best kept)")
    args = parser.parse_args(argv)
    from tests.integration.redis_server import cluster

    with cluster(masters=3, replicas_per_master=0) as group:
        url = group.url()
        best: dict[int, float] = {}
        for _ in range(args.runs):
            for shards in (1, 3):
                rate = measure(url, shards, args.processes, args.claims)
                best[shards] = max(best.get(shards, 0.0), rate)
    print(
        f"\nbeat's claims on a 3-master cluster, {args.processes} processes x "
        f"{args.claims:,} claims, best of {args.runs}\n"
    )
    for shards, rate in best.items():
        print(f"exactonce_shards={shards}: {rate:>12,.0f} claims/s")
    print(f"ratio 3 / 1: {best[3] / best[1]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
