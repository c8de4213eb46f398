"""Beat's sweep of delayed jobs: the due ``PENDING`` jobs claimed in batches and dispatched.

After its slots, each tick of :class:`~celery_exactonce.beat.scheduler.ExactOnceScheduler`
sweeps the delayed jobs that are due (``ExactOnceTask`` submissions and
retries with an ``eta`` or ``countdown``) with :func:`sweep`: ``claim_due``
moves them ``PENDING → SCHEDULED`` in ``run_at`` order, :data:`SWEEP_BATCH`
to a call and at most :data:`SWEEP_MAX_BATCHES` calls a tick, each job
claimed by one node, and each batch is dispatched before the next is claimed.

Not here: the tick and SIGTERM (:mod:`~celery_exactonce.beat.scheduler`, which
says when to stop), the dispatch (:mod:`~celery_exactonce.dispatch.dispatcher`), a
test's sweep (:meth:`ExactOnceJobs.sweep
<celery_exactonce.testing.jobs.ExactOnceJobs.sweep>`).
"""

from __future__ import annotations

from collections.abc import Callable

from celery_exactonce.beat.claimer import fail_closed
from celery_exactonce.core import exceptions
from celery_exactonce.runtime import Runtime

#: Delayed jobs claimed per ``claim_due`` call, and at most this many calls per tick.
SWEEP_BATCH = 500
SWEEP_MAX_BATCHES = 20


def sweep(runtime: Runtime, stopping: Callable[[], bool]) -> bool:
    """Dispatch due delayed jobs, after the slots; whether more may be due.

    Claims move them ``PENDING → SCHEDULED`` in ``run_at`` order, in
    batches of :data:`SWEEP_BATCH` (each job is claimed by one node), and
    each batch is dispatched before the next is claimed, so a SIGTERM
    (``stopping()``, asked before each batch) leaves no claimed job behind.
    A claim that errors after the store applied it leaves its jobs
    ``SCHEDULED`` for the reconciler to replay.
    """
    for _ in range(SWEEP_MAX_BATCHES):
        if stopping():
            return False
        try:
            claimed = runtime.store.claim_due(SWEEP_BATCH, node=runtime.node, reason="sweep")
        except exceptions.StoreError as exc:
            what = "delayed-job sweep cannot claim: nothing dispatched"
            fail_closed(runtime, "sweep_claim", what, exc)
            return False
        if claimed:
            runtime.dispatcher.dispatch_many(claimed, reason="sweep")
        if len(claimed) < SWEEP_BATCH:
            return False
    return True
