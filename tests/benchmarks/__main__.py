"""Benchmarks: store operations per second, and celery-exactonce against plain Celery.

Run with ``tox -e bench`` or ``python -m tests.benchmarks [--suite S[,S...]] [--small]``.
Suites (``--suite all``, the default, runs every one; ``--suite submit,e2e`` those two):

* ``stores``: create, CAS and claim per backend, one client looping against a
  fresh namespace (no concurrency), so each figure is the cost of one
  operation including its round trips. A create or CAS answers with the
  record; a *brief* one (``create_many``/``transition_many`` with ``brief``:
  beat's claims, a submit's create on the general path, the ``DISPATCHED``
  write, the worker gate and the completion write) may answer without it;
* ``beat`` and ``delayed``: see ``beat.py`` and ``delayed.py``;
* ``entries``: beat with 1,000 to 100,000 entries spread over a day: start-up,
  memory per entry, and the tick's cost against the entry count (``entries.py``);
* ``claims``: beat's claims per second per store, won and lost (``claims.py``);
* ``footprint``: bytes per terminal job on each store, with the default settings
  and with compacted terminal records, and the steady state of a Redis namespace
  against the formula of docs/design/scale.md (``footprint.py``);
* ``shards``: beat's claims on a 3-master Redis Cluster, the namespace on one
  shard against three: claims/s and the store's ceiling (``shards.py``);
* ``submit``, ``e2e``, ``group``: ``.delay()`` per store (the ``django://``
  store on PostgreSQL among them) and broker, no-op tasks through a real
  worker per store, and groups of 100 signatures, each from alternating plain
  and gated rounds of one run (``submit.py``, ``e2e.py``, ``group.py``,
  ``rounds.py``); and, in ``e2e``, an atomic task (``exactonce_atomic``)
  against the same gated task on a SQL store (``--atomic-stores``).

The run ends with a summary: every ratio against plain Celery it measured
(``submit``, ``e2e``, ``beat`` on each store), beside its target
(``summary.py``).

``--small`` makes every suite tiny (a smoke run of a minute or less): sizes
given on the command line still win.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta

from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.stores.base import StateStore
from tests import services
from tests.benchmarks import submit, summary
from tests.benchmarks.rounds import Rounds, table
from tests.support.backends import BACKENDS, DJANGO_BACKENDS, StoreFactory

#: Signatures in a group of the group suite.
GROUP_SIZE = 100


def _rate(n: int, fn: Callable[[int], object]) -> float:
    start = time.perf_counter()
    for i in range(n):
        fn(i)
    return n / (time.perf_counter() - start)


def bench_store(store: StateStore, n: int) -> dict[str, float]:
    past = store.now() - timedelta(minutes=1)
    scheduled = [
        NewJob(
            JobRef.submitted(f"s{i}"),
            "bench.task",
            State.SCHEDULED,
            node="bench",
            args=[i],
            kwargs={"k": "v"},
        )
        for i in range(n)
    ]
    pending = [
        NewJob(
            JobRef.submitted(f"p{i}"),
            "bench.task",
            State.PENDING,
            node="bench",
            run_at=past + timedelta(microseconds=i),
        )
        for i in range(n)
    ]
    brief = [
        NewJob(
            JobRef.submitted(f"b{i}"),
            "bench.task",
            State.SCHEDULED,
            node="bench",
            args=[i],
            kwargs={"k": "v"},
        )
        for i in range(n)
    ]
    figures = {
        "create": _rate(n, lambda i: store.create(scheduled[i])),
        "create (brief)": _rate(n, lambda i: store.create_many([brief[i]], brief=True)),
    }

    def dispatched(new: NewJob) -> Transition:
        return Transition(
            State.DISPATCHED,
            frozenset({State.SCHEDULED}),
            node="bench",
            reason="bench",
            rev=new.rev,
        )

    def cas(i: int) -> None:
        assert store.transition(scheduled[i].ref, dispatched(scheduled[i])).applied

    def cas_brief(i: int) -> None:
        (result,) = store.transition_many([(brief[i].ref, dispatched(brief[i]))], brief=True)
        assert result.applied

    figures["cas"] = _rate(n, cas)
    figures["cas (brief)"] = _rate(n, cas_brief)
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
        store.create(
            NewJob(
                JobRef.submitted("q" + new.ref.id),
                "bench.task",
                State.PENDING,
                node="bench",
                run_at=past,
            )
        )
    figures["claim (single)"] = _rate(n // 10, lambda _i: store.claim_due(1, node="bench"))
    return figures


#: What ``--small`` sets, unless the command line gives it.
SMALL = {
    "ops": 100,
    "entries": 200,
    "rounds": 2,
    "delayed": 500,
    "reconcile_jobs": "1000,2000",
    "submits": 50,
    "e2e_tasks": 100,
    "groups": 2,
    "entry_sizes": "200,2000",
    "entry_ticks": 50,
    "entry_due_ticks": 3,
    "claims": 1000,
    "shard_processes": 2,
    "shard_claims": 500,
    "shard_runs": 1,
    # The SQL store's paths of the e2e and beat suites, on one SQL store: a smoke run.
    "e2e_stores": "redis,postgres",
    "beat_stores": "redis,postgres",
    "footprint_jobs": 1000,
    "footprint_stores": "redis,postgres,sqlite",
    "steady_entries": 100,
    "steady_retention": 3.0,
}
#: Seconds of the beat suite's slot and of the reconcile suite's stale/fresh gap, small runs.
SMALL_SLOT_SECONDS = 2
# The fresh jobs must stay under the running timeout (half the gap) while the
# reconciler is built and its pass lists them: 1 s was not enough beside a busy suite.
SMALL_SETTLE = 4.0

SUITES = (
    "stores",
    "beat",
    "entries",
    "claims",
    "shards",
    "delayed",
    "submit",
    "e2e",
    "group",
    "footprint",
)


def _suites(text: str) -> tuple[str, ...]:
    """``--suite``: ``all``, or suites comma-separated (run in the order :data:`SUITES` has)."""
    asked = {name.strip() for name in text.split(",") if name.strip()}
    if asked == {"all"}:
        return SUITES
    unknown = sorted(asked - set(SUITES))
    if unknown or not asked:
        raise argparse.ArgumentTypeError(
            f"unknown suite(s) {', '.join(unknown) or repr(text)}: choose all or some of "
            + ", ".join(SUITES)
        )
    return tuple(name for name in SUITES if name in asked)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--ops", type=int, default=2000, help="operations per figure")
    parser.add_argument(
        "--backends",
        # Not the django:// stores: they need a Django project's settings (the tests'
        # come with pytest), and they are the SQL store on a Django connection.
        default=",".join(b for b in BACKENDS if b not in DJANGO_BACKENDS),
        help="stores of the stores and claims suites",
    )
    parser.add_argument(
        "--submit-stores", default=",".join(submit.STORES), help="stores (submit suite)"
    )
    parser.add_argument(
        "--e2e-stores", default="redis,postgres,mysql,sqlite", help="stores (e2e suite)"
    )
    parser.add_argument(
        "--atomic-stores",
        default="postgres",
        help="SQL stores of the e2e suite's atomic against gated rounds ('' for none)",
    )
    parser.add_argument("--beat-stores", default="redis,postgres", help="stores (beat suite)")
    parser.add_argument(
        "--suite",
        type=_suites,
        default=SUITES,
        help=f"which figures: all (the default), or some of {', '.join(SUITES)}, comma-separated",
    )
    parser.add_argument("--small", action="store_true", help="tiny sizes: a quick smoke run")
    parser.add_argument("--entries", type=int, default=10_000, help="beat entries (beat suite)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="plain/ours pairs of rounds (beat, submit, e2e, group suites); the ratio is the "
        "median of the pairs', so one pair a neighbour slowed does not decide it",
    )
    parser.add_argument(
        "--entry-sizes", default="1000,10000,100000", help="entry counts (entries suite)"
    )
    parser.add_argument("--entry-ticks", type=int, default=1000, help="idle ticks per size")
    parser.add_argument("--entry-due-ticks", type=int, default=30, help="due ticks per size")
    parser.add_argument("--claims", type=int, default=20_000, help="claims (claims suite)")
    parser.add_argument("--shard-processes", type=int, default=6, help="shards suite")
    parser.add_argument("--shard-claims", type=int, default=5000, help="claims per process")
    parser.add_argument("--shard-runs", type=int, default=2, help="runs per layout (best kept)")
    parser.add_argument("--delayed", type=int, default=100_000, help="due delayed jobs to sweep")
    parser.add_argument(
        "--reconcile-jobs", default="10000,1000000", help="small,large job counts of a pass"
    )
    parser.add_argument("--submits", type=int, default=3000, help=".delay() calls per round")
    parser.add_argument("--brokers", default=",".join(submit.BROKERS), help="submit suite")
    parser.add_argument("--e2e-tasks", type=int, default=3000, help="tasks per e2e round")
    parser.add_argument("--groups", type=int, default=20, help="groups of 100 per group round")
    parser.add_argument(
        "--footprint-jobs", type=int, default=20_000, help="terminal jobs a fill writes"
    )
    parser.add_argument(
        "--footprint-stores", default="redis,postgres,mysql,sqlite", help="footprint suite"
    )
    parser.add_argument(
        "--steady-entries", type=int, default=300, help="entries due each second (steady state)"
    )
    parser.add_argument(
        "--steady-retention", type=float, default=20.0, help="retention, s (steady state)"
    )
    args = parser.parse_args(argv)
    if args.small:
        parser.set_defaults(**SMALL)
        args = parser.parse_args(argv)
    # SIGINT unwinds the run (the e2e worker stopped, queues and keys removed), even when
    # the run was started with it ignored (a background job of a non-interactive shell).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    suites: tuple[str, ...] = args.suite
    figures = {
        "stores": stores,
        "beat": beat_figures,
        "entries": entries_figures,
        "claims": claims_figures,
        "shards": shards_figures,
        "delayed": delayed_figures,
        "submit": submit_figures,
        "e2e": e2e_figures,
        "group": group_figures,
        "footprint": footprint_figures,
    }
    status = 0
    for suite in suites:
        status = figures[suite](args) or status
    print("\n".join(summary.lines()))
    return status


def submit_figures(args: argparse.Namespace) -> int:
    if not services.answers("redis"):
        print(f"submit: skipped, {services.REDIS_URL} does not answer")
        return 1
    rows: list[tuple[str, Rounds]] = []
    floors: list[str] = []
    brokers = args.brokers.split(",")
    for store in (b for b in args.submit_stores.split(",") if b in submit.STORES):
        for broker in brokers:
            down = [
                s
                for s in (store, broker)
                if (service := submit.service_of(s)) and not services.answers(service)
            ]
            if down:
                url = services.SERVICE_URLS[down[0]]
                print(f"submit: {store} store, {broker} broker skipped, {url} does not answer")
                continue
            figures = submit.measure(store, broker, args.submits, args.rounds)
            rows.append((f"{store} / {broker}", figures))
            floors.append(_floor_line(f"{store} / {broker}", store, figures))
            summary.add(
                summary.Row(
                    f".delay() gated: {summary.store_name(store)} store / "
                    f"{summary.BROKER_NAMES.get(broker, broker)} broker",
                    f"{figures.plain_rate:,.0f} calls/s",
                    f"{figures.ours_rate:,.0f} calls/s",
                    tuple(figures.ratios),
                    summary.SUBMIT_TARGETS.get((store, broker)),
                )
            )
    if not rows:
        return 1
    print(
        f"\n.delay() of a gated task against the same plain task, {args.submits:,} calls a "
        f"round, {args.rounds} pairs of rounds, one client (main figure: redis / redis)\n"
    )
    print("\n".join(table("store / broker", "calls", rows)))
    print(
        "\nthe store's physics, this run: one write of a record's size and its commit on the"
        " store's server\n(submit.write_floor), the ratio a gated submit would reach costing"
        " plain's call plus that write\n(plain+write), and the same measured: the floor rounds,"
        " plain's calls each after one such write\n"
    )
    heads = (
        ("plain µs/call", 15),
        ("write µs", 10),
        ("plain+write", 13),
        ("measured", 10),
        ("ours", 7),
    )
    print(f"{'store / broker':<28}" + "".join(f"{head:>{width}}" for head, width in heads))
    print("\n".join(floors))
    return 0


def _floor_line(name: str, store: str, figures: Rounds) -> str:
    plain = 1e6 / figures.plain_rate
    floor = 1e6 * submit.write_floor(store)
    measured = figures.floor_ratio
    return (
        f"{name:<28}{plain:>15,.0f}{floor:>10,.0f}{plain / (plain + floor):>12.2f}x"
        + (f"{measured:>9.2f}x" if measured is not None else f"{'-':>10}")
        + f"{figures.ratio:>6.2f}x"
    )


def e2e_figures(args: argparse.Namespace) -> int:
    if not services.answers("redis"):
        print(f"e2e: skipped, {services.REDIS_URL} does not answer")
        return 1
    from tests.benchmarks import e2e

    rows: list[tuple[str, Rounds]] = []
    atomic_rows: list[tuple[str, Rounds]] = []
    status = 0
    runs = [(store, False) for store in args.e2e_stores.split(",") if store]
    runs += [(store, True) for store in args.atomic_stores.split(",") if store]
    for store, atomic in runs:
        service = submit.service_of(store)
        if service and not services.answers(service):
            print(f"e2e: {store} store skipped, {services.SERVICE_URLS[service]} does not answer")
            status = 1
            continue
        figures = e2e.run(args.e2e_tasks, args.rounds, store, atomic=atomic)
        name = summary.store_name(store)
        if atomic:
            atomic_rows.append((f"atomic against gated, {store}", figures))
            what = f"atomic no-op end to end against gated, {name} store"
            target = summary.ATOMIC_TARGETS.get(store)
        else:
            rows.append((f"prefork, queued first, {store}", figures))
            what = f"no-op end to end, prefork -c {e2e.CONCURRENCY}, {name} store"
            target = summary.E2E_TARGETS.get(store)
        summary.add(
            summary.Row(
                what,
                f"{figures.plain_rate:,.0f} tasks/s",
                f"{figures.ours_rate:,.0f} tasks/s",
                tuple(figures.ratios),
                target,
            )
        )
    if not rows and not atomic_rows:
        return 1
    print(
        f"\nno-op tasks through one prefork worker (-c {e2e.CONCURRENCY}), "
        f"{args.e2e_tasks:,} queued a round, {args.rounds} pairs of rounds, "
        "per store, on a Redis broker\n"
    )
    if rows:
        print("\n".join(table("worker, store", "tasks", rows)))
    if atomic_rows:  # ("plain" is the gated task here, "ours" the atomic one)
        print("\nthe same, an exactonce_atomic task (ours) against the gated one (as plain)\n")
        print("\n".join(table("worker, store", "tasks", atomic_rows)))
    return status


def group_figures(args: argparse.Namespace) -> int:
    if not services.answers("redis"):
        print(f"group: skipped, {services.REDIS_URL} does not answer")
        return 1
    from tests.benchmarks import group

    figures = group.run(args.groups, GROUP_SIZE, args.rounds)
    print(
        f"\ngroup(task.s(i) for i in range({GROUP_SIZE})).apply_async(), {args.groups} "
        f"groups a round, {args.rounds} pairs of rounds, on the Redis store and a Redis "
        "broker\n"
    )
    print("\n".join(table("group", "groups", [(f"{GROUP_SIZE} signatures", figures)])))
    print(
        f"{'(signatures/s)':<34}{figures.plain_rate * GROUP_SIZE:>16,.0f}"
        f"{figures.ours_rate * GROUP_SIZE:>16,.0f}"
    )
    return 0


def footprint_figures(args: argparse.Namespace) -> int:
    from tests.benchmarks import footprint

    rows = footprint.run(args.footprint_stores.split(","), args.footprint_jobs)
    if not rows:
        return 1
    print(
        f"\nbytes per terminal job: {args.footprint_jobs:,} jobs a store, half beat "
        "occurrences, half gated jobs\n"
    )
    print("\n".join(footprint.table(rows)))
    for setting, row in rows:
        summary.add_size(
            summary.Size(
                f"{summary.store_name(row.store)}, {setting} terminal records",
                row.per_job,
                footprint.TARGETS.get(row.store) if setting == "compact" else None,
            )
        )
    compact = next((r for s, r in rows if r.store == "redis" and s == "compact"), None)
    if compact is None:
        return 0
    state = footprint.steady_state(
        args.steady_entries, 1.0, args.steady_retention, 1.0, compact.per_job
    )
    print("\n".join(footprint.steady_lines(state)))
    summary.add_size(
        summary.Size("Redis steady state, measured / formula (%)", 100 * (1 + state.error), None)
    )
    return 0


def delayed_figures(args: argparse.Namespace) -> int:
    if not services.answers("redis"):
        print(f"delayed: skipped, {services.REDIS_URL} does not answer")
        return 1
    from tests.benchmarks import delayed

    small, large = (int(n) for n in args.reconcile_jobs.split(","))
    settle = SMALL_SETTLE if args.small else 5.0
    print("\ndelayed jobs and the reconciler on the Redis store and a Redis broker\n")
    for name, value in delayed.run(args.delayed, small, large, settle):
        print(f"{name:<45}{value:>30}")
    return 0


def entries_figures(args: argparse.Namespace) -> int:
    from tests.benchmarks import entries

    sizes = [int(n) for n in args.entry_sizes.split(",")]
    status = 0
    for store in ("memory", "redis"):
        if store == "redis" and not services.answers("redis"):
            print(f"entries: redis skipped, {services.REDIS_URL} does not answer")
            status = 1
            continue
        rows = entries.run(store, sizes, args.entry_ticks, args.entry_due_ticks)
        print()
        print("\n".join(entries.table(store, rows)))
    return status


def claims_figures(args: argparse.Namespace) -> int:
    from tests.benchmarks import claims

    rows = per_backend(
        args.backends, "claims: {}", lambda store: claims.measure(store, args.claims)
    )
    title = f"beat's claims, {args.claims:,} slots in batches of 500, one client"
    return print_rows(title, rows, 16, 20)


def shards_figures(args: argparse.Namespace) -> int:
    missing = [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]
    if missing:
        print(f"shards: skipped, {' and '.join(missing)} not installed")
        return 1
    from tests.benchmarks import shards

    best = shards.run(args.shard_processes, args.shard_claims, args.shard_runs)
    print("\n".join(shards.report(best, args.shard_processes, args.shard_claims, args.shard_runs)))
    return 0


def per_backend(
    backends: str, label: str, measure: Callable[[StateStore], dict[str, float]]
) -> list[tuple[str, dict[str, float]]]:
    """``measure`` on a fresh store of each backend that answers; a silent one is skipped,
    said as ``label`` (a format of the backend's name) ``skipped``."""
    rows: list[tuple[str, dict[str, float]]] = []
    for backend in backends.split(","):
        if backend in services.SERVICE_URLS and not services.answers(backend):
            print(
                f"{label.format(backend)} skipped, {services.SERVICE_URLS[backend]} does not answer"
            )
            continue
        factory = StoreFactory(backend)
        try:
            rows.append((backend, measure(factory())))
        finally:
            factory.cleanup()
    return rows


def print_rows(title: str, rows: list[tuple[str, dict[str, float]]], first: int, width: int) -> int:
    """The table of ``rows`` (a backend and its figures); status 1 when there is none."""
    if not rows:
        return 1
    columns = list(rows[0][1])
    print(f"\n{title}\n")
    print(f"{'backend':<{first}}" + "".join(f"{c:>{width}}" for c in columns))
    for backend, figures in rows:
        print(f"{backend:<{first}}" + "".join(f"{figures[c]:>{width},.0f}" for c in columns))
    return 0


def beat_figures(args: argparse.Namespace) -> int:
    if not services.answers("redis"):
        print(f"beat: skipped, {services.REDIS_URL} does not answer")
        return 1
    from tests.benchmarks import beat

    slot = SMALL_SLOT_SECONDS if args.small else beat.SLOT_SECONDS
    status = 0
    for store in args.beat_stores.split(","):
        service = submit.service_of(store)
        if service and not services.answers(service):
            print(f"beat: {store} store skipped, {services.SERVICE_URLS[service]} does not answer")
            status = 1
            continue
        print(f"\nbeat on the {summary.store_name(store)} store and a Redis broker\n")
        rows, ratios = beat.run(args.entries, args.rounds, slot, store)
        for name, value in rows:
            print(f"{name:<45}{value:>30}")
        figures = dict(rows)
        summary.add(
            summary.Row(
                f"{args.entries:,} entries due at once, one beat, {summary.store_name(store)}",
                figures[f"plain apply_async x {args.entries:,} (median)"].split(" (")[0],
                figures[f"beat, {args.entries:,} due in one slot (median)"].split(" (")[0],
                tuple(ratios),
                summary.BEAT_TARGETS.get(store),
                time=True,
            )
        )
    return status


def stores(args: argparse.Namespace) -> int:
    rows = per_backend(args.backends, "{}:", lambda store: bench_store(store, args.ops))
    title = f"store operations per second, {args.ops} ops each, one client"
    return print_rows(title, rows, 10, 34)


if __name__ == "__main__":
    sys.exit(main())
