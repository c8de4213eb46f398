"""Store benchmarks: operations per second for create, CAS and claim, per backend.

Run with ``tox -e bench`` or ``python -m tests.benchmarks [--ops N] [--backends a,b]``.
Each figure is a single-client loop against a fresh namespace (no concurrency),
so it measures the cost of one operation including its round trips. Later
issues add ratios against plain Celery measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from datetime import timedelta

from celery_exactonce.jobs import JobRef, NewJob, Transition
from celery_exactonce.states import State
from celery_exactonce.stores.base import StateStore
from tests import services
from tests.contract.backends import BACKENDS, StoreFactory


def _rate(n: int, fn: Callable[[int], object]) -> float:
    start = time.perf_counter()
    for i in range(n):
        fn(i)
    return n / (time.perf_counter() - start)


def bench_store(store: StateStore, n: int) -> dict[str, float]:
    past = store.now() - timedelta(minutes=1)
    scheduled = [NewJob(JobRef.task(f"s{i}"), "bench.task", State.SCHEDULED, node="bench",
                        args=[i], kwargs={"k": "v"}) for i in range(n)]  # fmt: skip
    pending = [NewJob(JobRef.task(f"p{i}"), "bench.task", State.PENDING, node="bench",
                      run_at=past + timedelta(microseconds=i)) for i in range(n)]  # fmt: skip
    figures = {"create": _rate(n, lambda i: store.create(scheduled[i]))}

    def cas(i: int) -> None:
        request = Transition(
            State.DISPATCHED, frozenset({State.SCHEDULED}), node="bench", reason="bench",
            rev=scheduled[i].rev,
        )  # fmt: skip
        assert store.transition(scheduled[i].ref, request).applied

    figures["cas"] = _rate(n, cas)
    for new in pending:
        store.create(new)
    batch = 100
    start = time.perf_counter()
    claimed = 0
    while claimed < n:
        got = store.claim_due(batch, node="bench")
        if not got:
            break
        claimed += len(got)
    figures["claim (jobs/s, batches of 100)"] = claimed / (time.perf_counter() - start)
    for new in pending[: n // 10]:
        store.create(NewJob(JobRef.task("q" + new.ref.id), "bench.task", State.PENDING,
                            node="bench", run_at=past))  # fmt: skip
    figures["claim (single)"] = _rate(n // 10, lambda _i: store.claim_due(1, node="bench"))
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks", description=__doc__)
    parser.add_argument("--ops", type=int, default=2000, help="operations per figure")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument(
        "--suite", choices=("stores", "beat", "delayed", "all"), default="all", help="which figures"
    )
    parser.add_argument("--entries", type=int, default=10_000, help="beat entries (beat suite)")
    parser.add_argument("--rounds", type=int, default=3, help="plain/beat pairs (beat suite)")
    parser.add_argument("--delayed", type=int, default=100_000, help="due delayed jobs to sweep")
    parser.add_argument(
        "--reconcile-jobs", default="10000,1000000", help="small,large job counts of a pass"
    )
    args = parser.parse_args(argv)
    status = 0
    if args.suite in ("stores", "all"):
        status = stores(args)
    if args.suite in ("beat", "all"):
        status = beat_figures(args) or status
    if args.suite in ("delayed", "all"):
        status = delayed_figures(args) or status
    return status


def delayed_figures(args: argparse.Namespace) -> int:
    if not services.answers("redis"):
        print(f"delayed: skipped, {services.REDIS_URL} does not answer")
        return 1
    from tests.benchmarks import delayed

    small, large = (int(n) for n in args.reconcile_jobs.split(","))
    print("\ndelayed jobs and the reconciler on the Redis store and a Redis broker\n")
    for name, value in delayed.run(args.delayed, small, large):
        print(f"{name:<45}{value:>30}")
    return 0


def beat_figures(args: argparse.Namespace) -> int:
    if not services.answers("redis"):
        print(f"beat: skipped, {services.REDIS_URL} does not answer")
        return 1
    from tests.benchmarks import beat

    print("\nbeat on the Redis store and a Redis broker\n")
    for name, value in beat.run(args.entries, args.rounds):
        print(f"{name:<45}{value:>30}")
    return 0


def stores(args: argparse.Namespace) -> int:
    rows: list[tuple[str, dict[str, float]]] = []
    for backend in args.backends.split(","):
        if backend in services.SERVICE_URLS and not services.answers(backend):
            print(f"{backend}: skipped, {services.SERVICE_URLS[backend]} does not answer")
            continue
        factory = StoreFactory(backend)
        try:
            rows.append((backend, bench_store(factory(), args.ops)))
        finally:
            factory.cleanup()
    if not rows:
        return 1
    columns = list(rows[0][1])
    print(f"\nstore operations per second, {args.ops} ops each, one client\n")
    print(f"{'backend':<10}" + "".join(f"{c:>34}" for c in columns))
    for backend, figures in rows:
        print(f"{backend:<10}" + "".join(f"{figures[c]:>34,.0f}" for c in columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
