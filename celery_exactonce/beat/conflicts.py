"""Claim conflicts: a slot found claimed by a record that is not this node's entry.

Two apps on one namespace that define one entry name differently (another
task, other arguments) compete for the same slots, and only the winner's job
runs. A node that finds a slot claimed by such a record logs a
``claim_conflict`` warning (at most once per entry every :data:`RECHECK`
seconds) and notes it on the record.

Not here: the claims themselves (:mod:`~celery_exactonce.beat.claimer`).
"""

from __future__ import annotations

import contextlib
import logging
from datetime import datetime

from celery_exactonce.beat.entries import entry_of, fire_of
from celery_exactonce.core import exceptions, refs
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.writes import NewJob
from celery_exactonce.observe import metrics
from celery_exactonce.stores.base import StateStore

#: Seconds (store time) before an entry whose slot was found claimed is compared
#: again with the record that holds it, and how many records a tick reads for that.
RECHECK = 600.0
CHECKS_PER_TICK = 8


class ConflictWatch:
    """Compares the slots a node found claimed with its own entries (see the module docs)."""

    def __init__(self, store: StateStore, node: str) -> None:
        self._store = store
        self._node = node
        self._checked: dict[str, datetime] = {}
        self._tick: datetime | None = None  # the tick the reads below were made in
        self._reads = 0

    def check(self, taken: list[tuple[NewJob, Job | None]], now: datetime) -> None:
        """Compare ``taken`` (this node's claim, the record if the store answered with it).

        Each entry is compared at most once every :data:`RECHECK` seconds, and
        at most :data:`CHECKS_PER_TICK` records are read per tick (a brief
        claim answers without the record).
        """
        if now != self._tick:  # a tick's batches share its reads
            self._tick, self._reads = now, 0
        for new, found in taken:
            record = found
            entry = entry_of(new)
            checked = self._checked.get(entry)
            if checked is not None and (now - checked).total_seconds() < RECHECK:
                continue
            if record is None:
                if self._reads >= CHECKS_PER_TICK:
                    continue
                self._reads += 1
                try:
                    record = self._store.get(new.ref)
                except exceptions.StoreError:
                    continue  # compared on a later tick
                if record is None:
                    continue  # purged meanwhile
            self._checked[entry] = now
            if record.task != new.task or (
                # a Celery retry may have given a later attempt other arguments
                record.attempt == 0 and (record.args, record.kwargs) != (new.args, new.kwargs)
            ):
                self._report(new, record)

    def _report(self, new: NewJob, record: Job) -> None:
        entry = entry_of(new)
        what = (
            f"task {record.task} instead of {new.task}"
            if record.task != new.task
            else f"task {record.task} with other arguments"
        )
        claimer = record.history[0].node if record.history else record.node
        metrics.event(
            "claim_conflict",
            f"beat entry {entry!r}: the slot {fire_of(new).isoformat()} was claimed as {what} "
            f"(node {claimer}): another app defines this entry name differently on this "
            "namespace, and this node's job does not run",
            level=logging.WARNING,
            entry=entry,
            job_id=new.ref.id,
            task=new.task,
            claimed_task=record.task,
            claimed_by=claimer,
        )
        note = (
            f"claim conflict: node {self._node} defines beat entry {entry!r} as "
            f"{new.task}{' with other arguments' if record.task == new.task else ''}; "
            "its job did not run"
        )
        # The record says it too, for whoever reads it later; a store error leaves the
        # warning above, and the next report (RECHECK) tries again.
        with contextlib.suppress(exceptions.StoreError):
            self._store.annotate(record.ref, node=self._node, reason=note, op_id=refs.new_token())
