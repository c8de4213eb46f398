"""A reconcile pass over the store's partitions, each under the reconciler's lease.

:class:`LeasedPasses` is the base of :class:`~celery_exactonce.reconcile.reconciler.Reconciler`
that runs a pass (docs/design/protocol.md, "The reconciler"). A store is one
partition, or several (:class:`~celery_exactonce.stores.base.Partitioned`:
the shards of a sharded Redis Cluster namespace, each with its own lease
keys). A pass goes over them, from an offset of this node's that moves on by
one each pass, so that two nodes start on different partitions and each
partition in turn comes first. For each it:

* takes the partition's lease :data:`LEASE_NAME` (token-checked,
  ``exactonce_lease_ttl``), and skips the partition when another node holds
  it (``held_elsewhere`` in the report);
* reconciles the partition (the reconciler's part: what it lists there, and
  does to each stale job), renewing the lease between batches. A transition
  guarded by the lease is checked on the partition where the record lives,
  which is where the pass listed it;
* releases the lease, whatever happened. A lease lost mid-way stops that
  partition only (``reconcile_lease_lost``, field ``partition``); the pass
  goes on with the next one.

One report sums every partition the pass reconciled. With one partition (every
store but a sharded one) this is the pass as it always was: one lease, the
store's own. Not here: what a pass does in a partition
(:mod:`~celery_exactonce.reconcile.reconciler`), the report and the tokens
(:mod:`~celery_exactonce.reconcile.passes`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from celery_exactonce.core import exceptions
from celery_exactonce.core.writes import Lease
from celery_exactonce.observe import metrics
from celery_exactonce.reconcile.passes import (
    Pass,
    PassReport,
    count_store_error,
    lease_token,
    report_pass,
)
from celery_exactonce.runtime import Runtime
from celery_exactonce.stores.base import StateStore, partitions_of
from celery_exactonce.stores.shards import shard_of

#: The lease every reconciler of a namespace takes, on each partition, for a pass.
LEASE_NAME = "reconcile"


class LeasedPasses:
    """Runs passes over ``runtime``'s store, partition by partition, each under its lease."""

    def __init__(self, runtime: Runtime, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.runtime = runtime
        self._monotonic = monotonic
        self._passes = 0  # passes run: the first partition of the next moves on by as many

    def run_pass(self) -> PassReport:
        """One bounded pass; returns what it did. Never raises for a store error."""
        report = PassReport()
        parts = partitions_of(self.runtime.store)
        token = lease_token(self.runtime.node)
        start = shard_of(self.runtime.node, len(parts)) + self._passes
        self._passes += 1
        for k in range(len(parts)):
            index = (start + k) % len(parts)
            self._partition(report, Lease(LEASE_NAME, token), parts[index], index)
        if report.ran:
            report_pass(report)
        return report

    def _pass(self, run: Pass) -> None:
        """Reconcile ``run.part``, whose lease is held (the reconciler's)."""
        raise NotImplementedError

    def _partition(self, report: PassReport, lease: Lease, part: StateStore, index: int) -> None:
        """Reconcile ``part`` under its lease; nothing while another node holds that."""
        try:
            if not part.acquire_lease(lease.name, lease.token, self.runtime.config.lease_ttl):
                report.held_elsewhere += 1
                return
        except exceptions.StoreError as exc:
            self._store_error(report, exc, "lease")
            return
        report.ran = True
        report.partitions += 1
        timeouts_ok = self._monotonic() >= self._grace_end()
        try:
            self._pass(Pass(report, lease, timeouts_ok, part=part, index=index))
        except exceptions.LeaseLost:
            report.lease_lost = True
            metrics.event(
                "reconcile_lease_lost",
                "the reconciler lost its lease mid-pass: stopped",
                level=logging.WARNING,
                partition=index,
            )
        finally:
            try:
                part.release_lease(lease.name, lease.token)
            except exceptions.StoreError as exc:
                self._store_error(report, exc, "lease")

    def _renew(self, run: Pass) -> None:
        """Renew the partition's lease; a lease another node took stops the partition."""
        lease = run.lease
        try:
            held = run.part.renew_lease(lease.name, lease.token, self.runtime.config.lease_ttl)
        except exceptions.StoreError:
            return  # the next write's lease guard decides
        if not held:
            raise exceptions.LeaseLost("lease not renewed: another reconciler holds it")

    def _grace_end(self) -> float:
        """When the grace period ends: ``running_timeout`` after the last store error.

        Any store-wide error this process met counts (the runtime's note), not
        only the reconciler's own: during an outage beat cannot even claim the
        pass, so the first pass after it would otherwise time out jobs whose
        heartbeats failed all along.
        """
        seen = self.runtime.store_error_at
        return -math.inf if seen is None else seen + self.runtime.config.running_timeout

    def _store_error(
        self, report: PassReport, exc: BaseException, where: str, *, outage: bool = True
    ) -> None:
        """Count a store error; an ``outage`` (not one job's write) starts the grace period."""
        if outage:
            self.runtime.note_store_error(self._monotonic())
        count_store_error(report, exc, where)
