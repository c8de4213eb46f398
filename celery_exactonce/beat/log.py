"""What a beat node says of itself: its banner, its start, and the epoch guard in plain words.

Stock beat logs its banner and one "Sending due task" line per dispatch; a
beat node of this package says, besides (through :func:`metrics.event`):

* ``beat_started``, once, at its first tick that reached the store: the node
  id, the store (credentials redacted), the namespace and the epoch it holds;
* ``epoch_guard``, once, when that epoch is young enough to hold slots back:
  what the store-loss guard (:mod:`~celery_exactonce.beat.store_loss`) does and
  until when. The slots it skips meanwhile are counted (``slot_skipped``,
  ``where=unprovable``) and reported at debug only, as this explains them.

Each occurrence's "Sending due task" line is the dispatcher's
(:mod:`~celery_exactonce.dispatch.dispatcher`, ``BEAT_REASON``).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from celery_exactonce.beat.store_loss import StoreLossGuard
from celery_exactonce.config import ExactOnceConfig
from celery_exactonce.core import refs
from celery_exactonce.observe import metrics
from celery_exactonce.stores import redact_url


def banner(config: ExactOnceConfig, node: str) -> str:
    """The line ``celery beat`` adds to its start-up banner (``Scheduler.info``)."""
    return (
        f"    . store -> {redact_url(config.store_url)} (namespace {config.namespace}, node {node})"
    )


def started(config: ExactOnceConfig, node: str, guard: StoreLossGuard, now: datetime) -> None:
    """The node's first tick read the store's clock (``now``) and epoch: say so, once."""
    store = redact_url(config.store_url)
    metrics.event(
        "beat_started",
        "celery-exactonce beat node %s started: store %s, namespace %s, epoch %s",
        node,
        store,
        config.namespace,
        guard.epoch,
        node=node,
        store=store,
        namespace=config.namespace,
        epoch=guard.epoch,
    )
    floor = guard.floor
    oldest = now - timedelta(seconds=config.window_lookback)
    if floor is None or floor <= oldest:
        return  # an older epoch: no slot beat would consider is held back
    born = refs.epoch_born(guard.epoch)
    held = [str(s) for s, at in enumerate(guard.floors) if at is not None and at > oldest]
    scope = (  # a sharded namespace with some shards older: those hold nothing back
        ""
        if len(held) == len(guard.floors)
        else f" On this sharded namespace this holds for the entries of shard(s) "
        f"{', '.join(held)} only: the other shards' epochs are older."
    )
    metrics.event(
        "epoch_guard",
        "The store's epoch began at %s: a new namespace, or a store that lost its data. "
        "Slots claimed before that could have been forgotten, so to be sure no slot runs "
        "twice, beat claims no slot at or before %s (the epoch's start plus exactonce_max_skew, "
        "%g s). Slots due until then are skipped on purpose, counted as slot_skipped "
        "(where=unprovable) and not logged one by one; beat claims every slot after it.%s",
        born.isoformat() if born is not None else "an unknown time",
        floor.isoformat(),
        config.max_skew,
        scope,
        epoch=guard.epoch,
        floor=floor.isoformat(),
    )
