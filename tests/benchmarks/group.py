"""Group benchmark: ``group(...).apply_async()`` of gated signatures against plain ones.

A round applies ``groups`` groups of ``size`` signatures one after the other,
``group(task.s(i) for i in range(size)).apply_async()``, building each group
inside the clock as a caller would. Plain and gated rounds alternate
(``tests/benchmarks/rounds.py``), in one process, on the Redis store and a
Redis broker; the tasks and their queues are those of the submit benchmark
(``submit.py``): each round's messages are counted on the broker (then
purged), so a round that published less fails. Figures are groups/s.
"""

from __future__ import annotations

import time

from celery import Task, group

from tests.benchmarks.rounds import Rounds, alternate
from tests.benchmarks.submit import Bench, bench_app


def _timed(bench: Bench, task: Task, groups: int, size: int) -> float:
    """Seconds to apply ``groups`` groups of ``size`` signatures of ``task``."""
    start = time.perf_counter()
    for _ in range(groups):
        group(task.s(i) for i in range(size)).apply_async()
    elapsed = time.perf_counter() - start
    bench.settle(task.queue, groups * size, f"group {task.name}")
    return elapsed


def run(groups: int = 20, size: int = 100, rounds: int = 3) -> Rounds:
    """``rounds`` pairs of ``groups`` plain and ``groups`` gated groups of ``size``."""
    with bench_app("redis", "redis", name="bench-group") as bench:
        for task in (bench.plain, bench.gated):  # connections opened, queues declared
            group(task.s(i) for i in range(size)).apply_async()
            bench.settle(task.queue, size, f"group warm-up ({task.name})")
        return alternate(
            rounds,
            groups,
            lambda: _timed(bench, bench.plain, groups, size),
            lambda: _timed(bench, bench.gated, groups, size),
        )
