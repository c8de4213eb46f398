"""End-to-end benchmark: no-op tasks through one real prefork worker, gated against plain.

One ``celery worker -P prefork -c 2`` (``tests/acceptance/harness.py``'s
``WorkerProcess`` on the app of ``e2e_app.py``) runs every round, on a
Redis broker and the store ``run`` is given: Redis, or another shared store
(``postgres``, ``mysql``, ``sqlite``: a file in the run's working directory).
A round queues ``count`` tasks on a fresh
queue (checked on the broker, not timed), then tells the idle worker to
consume that queue (``add_consumer``). Each body counts itself (``INCR`` of
the round's key); the counter is polled, every 1 ms until the first body has
run (the clock starts there: the worker takes up a new queue only when its
current Redis ``BRPOP`` times out, up to 1 s later), then every 5 ms until
the ``count``-th. The round's figure is the worker's rate over that window,
not its start-up; a round that ran fewer bodies than it queued fails, and
gated rounds must leave every job ``SUCCEEDED`` in the store.

Rounds alternate plain and gated (``tests/benchmarks/rounds.py``), after one
unmeasured round of each that connects the pool processes. The worker logs at
INFO as the acceptance tests' do (two lines per task, for both variants). The
queues, the counters and the store namespace are removed afterwards.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from celery_exactonce import runtime
from celery_exactonce.core.states import State
from tests.acceptance.harness import REPO_ROOT, WorkerProcess
from tests.benchmarks import e2e_app
from tests.benchmarks.rounds import Rounds, alternate
from tests.benchmarks.submit import broker_url
from tests.support.backends import store_url

#: Pool processes of the worker.
CONCURRENCY = 2
#: Tasks in the unmeasured round of each variant.
WARM_UP = 50
#: Seconds between two reads of a round's counter, before the first body ran and after.
FIRST_POLL_INTERVAL = 0.001
POLL_INTERVAL = 0.005


class E2E:
    """The worker, the app that sends to it, and the rounds (use :func:`deployment`)."""

    def __init__(self, workdir: Path, store: str = "redis") -> None:
        self.uid = uuid.uuid4().hex[:12]
        self.prefix = f"bench-e2e-{self.uid}:"
        self.broker_url = broker_url("redis")
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("EXACTONCE_BENCH_")}
        paths = [str(REPO_ROOT), *filter(None, inherited.get("PYTHONPATH", "").split(os.pathsep))]
        self.env = {
            **inherited,
            "PYTHONPATH": os.pathsep.join(paths),
            "PYTHONUNBUFFERED": "1",
            "EXACTONCE_BENCH_BROKER_URL": self.broker_url,
            "EXACTONCE_BENCH_REDIS_PREFIX": self.prefix,
            "EXACTONCE_BENCH_STORE_URL": store_url(store, str(workdir)),
            "EXACTONCE_BENCH_NAMESPACE": f"bench-{self.uid}",
            "EXACTONCE_BENCH_COUNTER_URL": self.broker_url,
        }
        self.app = e2e_app.make_app(self.env, set_as_current=False)
        self.counter = redis.Redis.from_url(self.broker_url)
        self.worker = WorkerProcess(
            self.env,
            workdir / "worker.log",
            queue=f"bench-e2e-idle-{self.uid}",
            concurrency=CONCURRENCY,
            name=f"bench-{self.uid}",
            app_module=e2e_app.__name__,
        )
        self.node = f"{self.worker.name}@{socket.gethostname()}"
        self.gated_runs = 0

    def start(self) -> None:
        runtime.runtime_for(self.app)  # the namespace exists before the worker's gate
        self.worker.start().wait_ready()

    def close(self) -> None:
        try:
            self.worker.terminate()
        finally:
            try:
                store = runtime.runtime_for(self.app).store
                store.drop_namespace()  # type: ignore[attr-defined]
            finally:
                runtime.reset(self.app)
                self.app.close()
                keys = list(self.counter.scan_iter(match=f"*{self.uid}*", count=500))
                if keys:
                    self.counter.delete(*keys)
                self.counter.close()

    def _waiting(self, queue: str) -> int:
        with self.app.connection_for_write() as conn:
            return int(conn.default_channel.queue_declare(queue=queue)[1])

    def _control(self, command: str, queue: str) -> None:
        replies = self.app.control.broadcast(
            command, arguments={"queue": queue}, destination=[self.node], reply=True, timeout=10
        )
        if not replies or any("error" in r for reply in replies for r in reply.values()):
            raise AssertionError(
                f"{command} {queue}: the worker answered {replies!r}; log:\n"
                f"{self.worker.log_tail()}"
            )

    def round(self, task: str, count: int) -> float:
        """Seconds ``count`` queued tasks take through the worker, at the rate measured.

        The rate is taken from the first body that ran to the last: the worker
        picks up the queue it was told to consume only when its current Redis
        ``BRPOP`` times out (up to 1 s), which is no cost of either variant.
        """
        queue, key = f"bench-e2e-{uuid.uuid4().hex}-{self.uid}", f"{self.prefix}done:{task}"
        self.counter.delete(key)
        send = self.app.tasks[task].apply_async
        for _ in range(count):
            send((key,), queue=queue)
        waiting = self._waiting(queue)
        if waiting != count:
            raise AssertionError(f"e2e {task}: {waiting} of {count} messages on the broker")
        deadline = time.monotonic() + 60 + count / 10
        self._control("add_consumer", queue)
        first, start = self._wait(task, key, 1, count, deadline, FIRST_POLL_INTERVAL)
        if first >= count:
            raise AssertionError(f"e2e {task}: {count} tasks ran before the first was seen")
        _, end = self._wait(task, key, count, count, deadline, POLL_INTERVAL)
        self._control("cancel_consumer", queue)
        self._check(task, key, queue, count)
        return (end - start) * count / (count - first)

    def _wait(
        self, task: str, key: str, at_least: int, count: int, deadline: float, interval: float
    ) -> tuple[int, float]:
        """Poll the round's counter until it reaches ``at_least``: its value, and when."""
        while (done := int(self.counter.get(key) or 0)) < at_least:
            if not self.worker.alive() or time.monotonic() > deadline:
                raise AssertionError(
                    f"e2e {task}: {done} of {count} bodies ran; log:\n{self.worker.log_tail()}"
                )
            time.sleep(interval)
        return done, time.perf_counter()

    def _check(self, task: str, key: str, queue: str, count: int) -> None:
        """Every body ran once, nothing is left on the queue, every gated job SUCCEEDED."""
        done, waiting = int(self.counter.get(key) or 0), self._waiting(queue)
        succeeded = None
        if task in (e2e_app.GATED, e2e_app.ATOMIC):
            self.gated_runs += count
            store = runtime.runtime_for(self.app).store
            # A body counts itself before its completion write: the last ones may still
            # be writing (a SQL store's commit) when the counter says done.
            deadline = time.monotonic() + 30
            while (
                succeeded := len(store.list_stale(State.SUCCEEDED, 0, self.gated_runs + 1))
            ) < self.gated_runs and time.monotonic() < deadline:
                time.sleep(POLL_INTERVAL)
        if done != count or waiting or succeeded not in (None, self.gated_runs):
            raise AssertionError(
                f"e2e {task}: {done} bodies ran of {count}, {waiting} messages left, "
                f"{succeeded} jobs SUCCEEDED of {self.gated_runs}"
            )
        with self.app.connection_for_write() as conn:
            conn.default_channel.queue_delete(queue)


@contextmanager
def deployment(store: str = "redis") -> Iterator[E2E]:
    """A started :class:`E2E` on ``store``, closed (worker stopped, everything removed) after."""
    workdir = Path(tempfile.mkdtemp(prefix="exactonce-bench-e2e-"))
    e2e = E2E(workdir, store)
    try:
        e2e.start()
        yield e2e
    finally:
        try:
            e2e.close()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)


def run(
    count: int = 3000, rounds: int = 3, store: str = "redis", *, atomic: bool = False
) -> Rounds:
    """``rounds`` pairs of ``count`` plain and ``count`` gated tasks through the worker.

    ``atomic``: the gated task's rounds (as "plain") against the atomic task's
    (as "ours"), on a SQL store.
    """
    first, second = (e2e_app.GATED, e2e_app.ATOMIC) if atomic else (e2e_app.PLAIN, e2e_app.GATED)
    with deployment(store) as e2e:
        for task in (first, second):
            e2e.round(task, min(WARM_UP, count))
        return alternate(
            rounds, count, lambda: e2e.round(first, count), lambda: e2e.round(second, count)
        )
