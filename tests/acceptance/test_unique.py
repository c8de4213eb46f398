"""Unique submissions with real processes: ten submitters of one key, a holder's end, its crash.

One worker runs ``unique_app.hold``, whose body holds until the test releases
its key. While job A of key ``k`` runs, ten processes call ``hold.delay("k")``
1,000 times each: every call answers A, and the namespace holds one job.
Once A ends, the next call creates B. The worker is then SIGKILLed while B
runs: calls still answer B, until a reconcile pass ends B (its heartbeats
stopped: ``exactonce_running_timeout`` of 5 s); the next call creates C. No
TTL decides any of it: the figures (how long after the SIGKILL the key came
free) are printed.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.stores.base import StateStore
from tests import services
from tests.acceptance.examples import empty_redis, fresh_redis
from tests.acceptance.harness import REPO_ROOT, WorkerProcess, poll, process_env
from tests.support.backends import make_store, store_url

APP = "tests.acceptance.apps.unique_app"
#: The broker's Redis database: this test's alone, emptied before and after.
BROKER_DB = 6
SUBMITTERS, CALLS = 10, 1000


def submit(env: dict[str, str], where: Path, key: str, calls: int = 1) -> subprocess.Popen[str]:
    out = where / f"ids-{uuid.uuid4().hex}"
    process = subprocess.Popen(
        [sys.executable, "-m", APP, key, str(calls), str(out)],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    process.out = out  # type: ignore[attr-defined]
    return process


def ids_of(process: subprocess.Popen[str], timeout: float = 120) -> list[str]:
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output
    return process.out.read_text(encoding="utf-8").split()  # type: ignore[attr-defined]


def one(env: dict[str, str], where: Path, key: str) -> str:
    (task_id,) = ids_of(submit(env, where, key))
    return task_id


def jobs_in(store: StateStore) -> int:
    return sum(store.count_by_state().values())


def state(store: StateStore, task_id: str) -> State | None:
    job = store.get(JobRef.submitted(task_id))
    return None if job is None else job.state


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "backend",
    ["redis", pytest.param("postgres", marks=pytest.mark.slow)],  # 35 s: tox -e chaos
)
def test_ten_submitters_get_the_live_job_and_a_crashed_holder_frees_its_key(
    tmp_path: Path, backend: str
) -> None:
    services.need(backend)
    (broker,) = fresh_redis(BROKER_DB)
    namespace = f"uniq-{uuid.uuid4().hex[:10]}"
    url = store_url(backend, str(tmp_path))
    store = make_store(backend, url, namespace)
    env = process_env(
        EXACTONCE_UNIQ_BROKER=broker,
        EXACTONCE_UNIQ_QUEUE=f"unique-{namespace}",
        EXACTONCE_UNIQ_STORE=url,
        EXACTONCE_UNIQ_NAMESPACE=namespace,
        EXACTONCE_UNIQ_DIR=str(tmp_path),
    )
    worker = WorkerProcess(
        env, tmp_path / "worker.log", queue=f"unique-{namespace}", app_module=APP
    )
    try:
        worker.start().wait_ready()
        a = one(env, tmp_path, "k")
        poll((tmp_path / f"started-{a}").exists, timeout=60, interval=0.1)

        started = time.monotonic()
        submitters = [submit(env, tmp_path, "k", CALLS) for _ in range(SUBMITTERS)]
        answers = [task_id for process in submitters for task_id in ids_of(process)]
        took = time.monotonic() - started
        assert len(answers) == SUBMITTERS * CALLS
        assert set(answers) == {a}  # every call: the live job
        assert jobs_in(store) == 1
        assert state(store, a) is State.RUNNING
        print(f"\n{backend}: {len(answers)} calls by {SUBMITTERS} processes in {took:.1f} s, 1 job")

        (tmp_path / "release-k").touch()
        poll(lambda: state(store, a) is State.SUCCEEDED, timeout=60, interval=0.1)
        (tmp_path / "release-k").unlink()
        b = one(env, tmp_path, "k")
        assert b != a and jobs_in(store) == 2  # ended: the next call is a new job
        poll((tmp_path / f"started-{b}").exists, timeout=60, interval=0.1)

        worker.kill()  # the holder's worker is gone, B stays RUNNING in the store
        killed = time.monotonic()
        assert one(env, tmp_path, "k") == b

        def reconciled() -> bool:
            subprocess.run(
                [sys.executable, "-m", "celery", "-A", APP, "exactonce", "reconcile"],
                cwd=REPO_ROOT, env=env, capture_output=True, timeout=60, check=True,
            )  # fmt: skip
            return state(store, b) not in (State.RUNNING, None)

        poll(reconciled, timeout=90, interval=0.5)
        ended = state(store, b)
        c = one(env, tmp_path, "k")
        freed = time.monotonic() - killed
        assert c not in (a, b) and jobs_in(store) == 3
        print(f"{backend}: holder SIGKILLed, {ended} by the reconciler, key free {freed:.1f} s on")
    finally:
        (tmp_path / "release-k").touch()
        worker.kill()
        drop = getattr(store, "drop_namespace", None)
        if drop is not None:
            drop()
        store.close()
        empty_redis([broker])


@pytest.mark.timeout(120)
def test_control_celery_once_keeps_a_crashed_holders_lock_until_its_ttl(tmp_path: Path) -> None:
    """The same crash under celery-once: its lock outlives the worker, and refuses calls for
    the rest of its hour."""
    (broker,) = fresh_redis(BROKER_DB)
    queue = f"once-{uuid.uuid4().hex[:10]}"
    env = process_env(
        EXACTONCE_UNIQ_BROKER=broker, EXACTONCE_UNIQ_QUEUE=queue, EXACTONCE_UNIQ_DIR=str(tmp_path)
    )
    once = "tests.acceptance.apps.once_app"
    worker = WorkerProcess(env, tmp_path / "worker.log", queue=queue, app_module=once)

    def call() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", once, "k"],
            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    try:
        worker.start().wait_ready()
        assert call().returncode == 0
        poll(lambda: any(tmp_path.glob("started-*")), timeout=60, interval=0.1)
        worker.kill()
        refused = call()
        assert refused.returncode == 3, refused.stdout + refused.stderr  # AlreadyQueued
        left = float(refused.stdout.split()[-1])
        assert left > 3500  # the lock outlives its holder: refused for about an hour
        print(f"\ncelery-once: holder SIGKILLed; calls refused, its lock has {left:.0f} s left")
    finally:
        (tmp_path / "release-k").touch()
        worker.kill()
        empty_redis([broker])
