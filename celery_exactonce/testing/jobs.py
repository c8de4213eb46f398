"""ExactOnceJobs: what the store holds of an app's jobs, read and asserted on in tests.

The ``exactonce_jobs`` fixture is one of these. It reads the store of the app
(in tests, the in-memory store the plugin installs) and answers:

* which jobs there are: :meth:`~ExactOnceJobs.all`, :meth:`~ExactOnceJobs.get`
  (by task id or result), :meth:`~ExactOnceJobs.by_task`,
  :meth:`~ExactOnceJobs.by_state`;
* how many times a body ran: :meth:`~ExactOnceJobs.runs` counts the passes
  through the gate (one per attempt: a retried job ran once per attempt), and
  :meth:`~ExactOnceJobs.assert_ran_once` fails with the jobs' histories when
  that is not exactly one;
* the idempotency key of a job (:meth:`~ExactOnceJobs.key_of`), or of a task
  id before it is submitted (:meth:`~ExactOnceJobs.key_for`).

Every read first waits, bounded, until the jobs it reads have settled
(:meth:`~ExactOnceJobs.wait`), so the same test reads the same in eager mode
(where a job has ended when ``delay`` returns) and with an in-process worker.
:meth:`~ExactOnceJobs.sweep` dispatches the delayed jobs that are due, as a
beat node would, optionally moving the frozen clock to a given time first.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.dispatch import messages
from celery_exactonce.runtime import runtime_for
from celery_exactonce.testing.clock import FrozenClock

__all__ = ["ExactOnceJobs"]

#: ``list_stale`` with a cut-off this far ahead of store time lists every job of a state.
_EVERY = -10 * 365 * 86_400.0
_PAGE = 1000
#: A job in these states is still on its way (a worker will move it on).
_MOVING = frozenset({State.SCHEDULED, State.DISPATCHED, State.RUNNING})
#: Publish options of a test sweep: no ``eta`` (see :meth:`ExactOnceJobs.sweep`).
_NO_ETA = {"eta": None}


class ExactOnceJobs:
    """The jobs of ``app`` in its store, for assertions (the ``exactonce_jobs`` fixture).

    A *target* names jobs: a task id (``str``) or a result (anything with an
    ``id``, such as ``AsyncResult`` or ``EagerResult``) names one job; a task
    (an ``ExactOnceTask``) names every job of that task.

    Parameters
    ----------
    app:
        The Celery app whose store is read.
    clock:
        The store's :class:`FrozenClock`, which :meth:`sweep` may move.
    timeout:
        How long :meth:`wait` (and every read that waits) waits, in seconds.
    """

    def __init__(
        self, app: Any, *, clock: FrozenClock | None = None, timeout: float = 10.0
    ) -> None:
        self.app = app
        self.clock = clock
        self.timeout = timeout

    @property
    def store(self) -> Any:
        """The app's store in this process."""
        return runtime_for(self.app).store

    # -- reading -------------------------------------------------------------------------

    def all(self) -> list[Job]:
        """Every job in the store, oldest first."""
        store = self.store
        found: list[Job] = []
        for state in State:
            after: tuple[datetime, JobRef] | None = None
            while True:
                page = store.list_stale(state, _EVERY, _PAGE, after=after)
                found.extend(page)
                if len(page) < _PAGE:
                    break
                after = (page[-1].touched_at, page[-1].ref)
        return sorted(found, key=lambda job: (job.created_at, str(job.ref)))

    def find(self, target: Any) -> Job | None:
        """The job of a task id or result, or ``None``."""
        job_id = _job_id(target)
        store = self.store
        job: Job | None = store.get(JobRef.submitted(job_id))
        return job if job is not None else store.get(JobRef.occurrence(job_id))

    def get(self, target: Any) -> Job:
        """The job of a task id or result; ``AssertionError`` if there is none."""
        job = self.find(target)
        if job is None:
            raise AssertionError(f"no job {_job_id(target)!r} in the store")
        return job

    def by_task(self, task: Any) -> list[Job]:
        """The jobs of ``task`` (a task or its name), oldest first."""
        name = task if isinstance(task, str) else task.name
        return [job for job in self.all() if job.task == name]

    def by_state(self, *states: State | str) -> list[Job]:
        """The jobs in any of ``states`` (``State`` members or their names), oldest first."""
        wanted = {State(state) for state in states}
        return [job for job in self.all() if job.state in wanted]

    def of(self, target: Any) -> list[Job]:
        """The jobs a target names (see the class docs): one, or a task's."""
        if _is_task(target):
            return self.by_task(target)
        job = self.find(target)
        return [] if job is None else [job]

    # -- runs ----------------------------------------------------------------------------

    def wait(self, target: Any = None, timeout: float | None = None) -> list[Job]:
        """Wait until the target's jobs (all jobs, without one) have settled; return them.

        Settled: ended (a terminal state) or waiting for its time (``PENDING``);
        not ``SCHEDULED``, ``DISPATCHED`` or ``RUNNING``. Raises
        ``AssertionError`` naming the jobs still moving after ``timeout``
        seconds (the instance's by default).
        """
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            jobs = self.all() if target is None else self.of(target)
            moving = [job for job in jobs if job.state in _MOVING]
            if not moving:
                return jobs
            if time.monotonic() >= deadline:
                raise AssertionError(
                    "jobs still on their way after "
                    f"{self.timeout if timeout is None else timeout:g} s:\n{describe(moving)}"
                )
            time.sleep(0.01)  # polling the store, under the deadline above

    def runs(self, target: Any) -> int:
        """How many times the body of the target's jobs ran (passes through the gate).

        Waits for them to settle first (:meth:`wait`). A retried job ran once
        per attempt.
        """
        return sum(_runs(job) for job in self.wait(target))

    def assert_ran_once(self, target: Any) -> Job:
        """Assert the target names one job whose body ran exactly once; return that job.

        Waits for it to settle first. For a task: exactly one job of that task,
        run once. Fails with the jobs found and their histories otherwise.
        """
        jobs = self.wait(target)
        total = sum(_runs(job) for job in jobs)
        if len(jobs) != 1 or total != 1:
            raise AssertionError(
                f"expected {_describe_target(target)} to run once; it ran {total} time(s) "
                f"in {len(jobs)} job(s)" + (f":\n{describe(jobs)}" if jobs else "")
            )
        return jobs[0]

    def assert_not_run(self, target: Any) -> None:
        """Assert the body of the target's jobs never ran (there may be no job at all)."""
        jobs = self.wait(target)
        total = sum(_runs(job) for job in jobs)
        if total:
            raise AssertionError(
                f"expected {_describe_target(target)} not to run; it ran {total} time(s):\n"
                f"{describe(jobs)}"
            )

    # -- keys and delayed jobs -----------------------------------------------------------

    def key_of(self, target: Any) -> str:
        """The idempotency key the body of the target's job sees (its messages' header)."""
        return messages.job_idempotency_key(self.get(target), self.store.namespace)

    def key_for(self, task_id: str) -> str:
        """The idempotency key a job submitted as ``task_id`` will carry (before it exists)."""
        return messages.submitted_key(task_id, self.store.namespace)

    def sweep(self, *, until: datetime | None = None) -> list[Job]:
        """Dispatch the delayed jobs due by store time, as a beat node does; return them.

        With ``until``, the frozen clock first moves forward to it (a job's
        ``run_at``, say): ``sweep(until=job.run_at)`` makes that job due.
        ``until=None`` leaves the clock where it is. Unlike beat's sweep, the
        message carries no ``eta``: the store's clock may be ahead of the
        worker's, which would hold the message until its own clock got there.
        """
        if until is not None:
            if self.clock is None:
                raise ValueError(
                    "sweep(until=...) moves the store's FrozenClock: this ExactOnceJobs has none"
                )
            if until > self.clock.now():
                self.clock.set(until)
        runtime = runtime_for(self.app)
        swept: list[Job] = []
        while True:
            claimed = runtime.store.claim_due(_PAGE, node=runtime.node, reason="sweep (test)")
            if claimed:
                runtime.dispatcher.dispatch_many(claimed, reason="sweep (test)", call=_NO_ETA)
            swept.extend(claimed)
            if len(claimed) < _PAGE:
                return swept


def describe(jobs: Iterable[Job]) -> str:
    """One block per job: id, task, state, attempt, reason, and its history."""
    blocks = []
    for job in jobs:
        lines = [f"  {job.ref.id} {job.task}: {job.state} at attempt {job.attempt} ({job.reason})"]
        start = job.history[0].at if job.history else job.created_at
        for entry in job.history:
            offset = (entry.at - start) / timedelta(seconds=1)
            src = entry.src.value if entry.src else "-"
            lines.append(f"    +{offset:.3f}s {src} -> {entry.dst.value}: {entry.reason}")
        blocks.append("\n".join(lines))
    return "\n".join(blocks)


def _runs(job: Job) -> int:
    """Passes through the gate in the job's history (a take-over is not a new run)."""
    return sum(1 for e in job.history if e.dst is State.RUNNING and e.src is not State.RUNNING)


def _is_task(target: Any) -> bool:
    return hasattr(target, "name") and hasattr(target, "run") and hasattr(target, "apply_async")


def _job_id(target: Any) -> str:
    if isinstance(target, str):
        return target
    job_id = getattr(target, "id", None)
    if not isinstance(job_id, str):
        raise TypeError(f"expected a task id, a result or a task, got {target!r}")
    return job_id


def _describe_target(target: Any) -> str:
    return f"task {target.name}" if _is_task(target) else f"job {_job_id(target)!r}"
