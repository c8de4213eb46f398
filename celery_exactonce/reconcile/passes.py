"""A reconcile pass as values: what it did, what its handlers share, and its records.

* :class:`PassReport`: what one pass did (``Reconciler.run_pass`` returns it);
* :class:`Pass`: the state of one pass over one partition of the store
  (:func:`~celery_exactonce.stores.base.partitions_of`), handed to every
  handler (the pass's report, the partition and its lease, whether timeouts
  may act, the store's time of the page);
* :func:`lease_token` and :func:`lease_holder`: the lease's token names the
  node that holds it (``celery exactonce status`` shows it);
* :func:`count_actions`: what earlier passes did to a job, from its history
  (the caps on replays, redispatches and re-runs count them);
* the records: :func:`count_store_error` (``reconcile_store_error``) and
  :func:`report_pass` (``stale_jobs``, ``reconcile_pass``), at the end of a pass.

Not here: what a pass does to each stale job and its bounds
(:mod:`~celery_exactonce.reconcile.reconciler`), its partitions and their leases
(:mod:`~celery_exactonce.reconcile.leased_passes`); running passes on beat or as a task
(:mod:`~celery_exactonce.reconcile.task`).
"""

from __future__ import annotations

import dataclasses
import logging
from datetime import datetime
from typing import Any

from celery_exactonce.core import refs, times
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.writes import Action, Lease
from celery_exactonce.observe import metrics
from celery_exactonce.stores.base import StateStore


@dataclasses.dataclass
class PassReport:
    """What one pass did, summed over the partitions it reconciled.

    ``ran`` is ``False`` when another node held the lease of every partition
    (of the store, when it has one: every store but a sharded one).
    ``partitions``: those it reconciled under their lease; ``held_elsewhere``:
    those it skipped, another node holding their lease.
    """

    ran: bool = False
    stale: dict[str, int] = dataclasses.field(default_factory=dict)
    replayed: int = 0
    redispatched: int = 0
    rerun: int = 0
    timed_out: int = 0
    failed: int = 0
    cancelled: int = 0
    expired: int = 0
    errors: int = 0
    skipped: int = 0
    lease_lost: bool = False
    partitions: int = 0
    held_elsewhere: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        """The figures that are not zero, for people: ``replayed=1 timed_out=2``."""
        if not self.ran:
            return "not run: another node holds the lease"
        hidden = ("ran", "stale", "partitions")
        figures = {k: v for k, v in self.as_dict().items() if v and k not in hidden}
        stale = sum(self.stale.values())
        text = " ".join(f"{k}={v}" for k, v in {"stale": stale, **figures}.items() if v)
        return text or "nothing to do"


def lease_token(node: str) -> str:
    """A new token for the reconciler's lease that names its holder: ``<random>@<node>``."""
    return f"{refs.new_token()}@{node}"[: refs.MAX_NAME_LENGTH]


def lease_holder(token: str) -> str | None:
    """The node a :func:`lease_token` names (``None`` for a token of another form)."""
    _, sep, node = token.partition("@")
    return node if sep and node else None


@dataclasses.dataclass
class Pass:
    """The state of one pass over one partition, handed to every handler."""

    report: PassReport
    lease: Lease
    #: Whether timeouts may act (not within the grace period after a store error).
    timeouts_ok: bool
    #: The partition (the store, or one of its shards) whose ``lease`` is held, and its
    #: place among the store's partitions. Writes go through the whole store, which
    #: routes each to the partition its record lives on.
    part: StateStore
    index: int
    #: The store's time when the page being acted on was listed.
    now: datetime = times.UNIX_EPOCH


def count_actions(job: Job, action: Action) -> int:
    """How many of the job's (capped) history entries record ``action``.

    Replays and redispatches each add entries far below the history cap
    before their own cap is reached, so the count is exact where it matters.
    """
    return sum(1 for entry in job.history if entry.action is action)


def count_store_error(report: PassReport, exc: BaseException, where: str) -> None:
    """Count a store error the pass met ``where`` in ``report``, and log it."""
    report.errors += 1
    metrics.event(
        "reconcile_store_error",
        f"reconciler: store error ({where}): {exc}",
        level=logging.WARNING,
        detail=where,
    )


def report_pass(report: PassReport) -> None:
    """The records of a pass that ran: the stale jobs listed per state (debug), then its figures."""
    for state, count in report.stale.items():
        if count:
            metrics.event(
                "stale_jobs",
                f"reconcile pass: {count} stale {state} job(s) listed",
                level=logging.DEBUG,
                labels={"state": state},
                count=count,
            )
    figures = {k: v for k, v in report.as_dict().items() if v}
    metrics.event("reconcile_pass", f"reconcile pass: {figures}", figures=figures)
    metrics.reconcile_pass_finished()
