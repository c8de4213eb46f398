"""The claims of a beat tick: one create-if-absent per slot, sorted by what the store answered.

A batch of occurrences goes to the store in one round trip
(:func:`~celery_exactonce.stores.settle.create_many`, brief: statuses only,
one read back per claim whose answer was lost). Each claim is then *won*
(this node created it, or its own earlier write did), *taken* (another record
holds the slot), *refused* (an epoch mismatch: the store lost data) or
*failed* (a store error, and no record read back: the slot stays undecided).

Not here: which slots to claim (:mod:`~celery_exactonce.beat.planner`), what beat
does with each outcome (:mod:`~celery_exactonce.beat.claimer`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from datetime import datetime

from celery_exactonce.beat.entries import entry_of
from celery_exactonce.core import exceptions, jobs
from celery_exactonce.core.jobs import CreateStatus, Job
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.observe import metrics
from celery_exactonce.stores import settle
from celery_exactonce.stores.base import StateStore


@dataclasses.dataclass
class Claimed:
    """What the store answered to a batch of claims, in the batch's order within each list."""

    won: list[tuple[NewJob, Job]] = dataclasses.field(default_factory=list)
    #: Another record holds the slot (with it, if the store answered with it).
    taken: list[tuple[NewJob, Job | None]] = dataclasses.field(default_factory=list)
    refused: list[NewJob] = dataclasses.field(default_factory=list)
    failed: list[NewJob] = dataclasses.field(default_factory=list)
    #: The store error of the batch, if any (some claims may have been decided by read-back).
    error: exceptions.StoreError | None = None


def claim(
    store: StateStore, batch: Sequence[NewJob], *, epoch: str | None, now: datetime
) -> Claimed:
    """Claim ``batch`` (``SCHEDULED`` occurrences) under ``epoch``, at store time ``now``.

    A won job is built here from the request (its ``rev`` is ours) when the
    store answered briefly; the ``DISPATCHED`` CAS returns the stored record,
    and that is what is published.
    """
    # One read back per claim whose answer was lost: a tick does not wait out an outage.
    results = settle.create_many(store, list(batch), epoch=epoch, brief=True, tries=1)
    claimed = Claimed(error=results[0].error if results else None)
    for new, result in zip(batch, results, strict=True):
        if result.status is None:  # lost, and no record read back
            claimed.failed.append(new)
        elif result.status is CreateStatus.EPOCH_MISMATCH:
            claimed.refused.append(new)
        elif result.status is CreateStatus.CREATED:
            claimed.won.append((new, result.job or jobs.job_from_new(new, now)))
        elif result.applied and result.job is not None:  # our record, as the store holds it
            if result.job.state is State.SCHEDULED:
                claimed.won.append((new, result.job))
        else:
            metrics.event(
                "slot_already_claimed",
                "%s at %s already claimed (%s)",
                entry_of(new),
                new.fire_time,
                result.status.value,
                level=logging.DEBUG,
                entry=entry_of(new),
            )
            if result.status is CreateStatus.EXISTS:
                claimed.taken.append((new, result.job))
    return claimed
