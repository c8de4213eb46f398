"""SCENARIOS 71: a Sentinel failover to a replica that missed the last claims.

Two beat nodes on one ``redis+sentinel://`` store. Node A claims an occurrence
while both replicas are paused (SIGSTOP), then the master is SIGKILLed before
they resume: the replica the sentinels promote never saw the claim. Node B,
after the failover, finds the slot free and claims it.

* ``exactonce_min_replicas=1``: A's claim is not confirmed, so A publishes
  nothing; only B dispatches. No occurrence is dispatched twice.
* ``exactonce_min_replicas=0``: A's claim counted on the master alone, A
  published, and B publishes again: the residual risk, counted here (one
  duplicate) and documented in docs/howto/beat.md and docs/howto/store-redis.md.

The replicas miss the claim because the master closes their links while they
are paused (``CLIENT KILL TYPE replica``): they cannot reconnect before the
master dies. A node here does what beat's claimer does with a claim: dispatch it when the
claim is known to have applied (``settle``), nothing otherwise.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import pytest
from celery import Celery

from celery_exactonce import ExactOnceConfig, StoreUnavailable, open_store
from celery_exactonce.core.jobs import Job
from celery_exactonce.dispatch.dispatcher import Dispatcher
from celery_exactonce.dispatch.outcomes import Outcome
from celery_exactonce.stores import settle
from celery_exactonce.stores.base import StateStore
from tests.integration.redis_server import sentinel_group, wait_for
from tests.support.helpers import occurrence


class Broker:
    def __init__(self) -> None:
        self.sent: list[Job] = []

    def __call__(self, job: Job, headers: Mapping[str, Any], extra: Mapping[str, Any]) -> None:
        self.sent.append(job)


def _config(url: str, min_replicas: int) -> ExactOnceConfig:
    app = Celery("scenario-71", set_as_current=False)
    app.conf.exactonce_store_url = url
    app.conf.exactonce_store_timeout = 1.0
    app.conf.exactonce_min_replicas = min_replicas
    return ExactOnceConfig.from_app(app)


def claim_and_dispatch(store: StateStore, fire: datetime, broker: Broker, node: str) -> bool:
    """One node's claim of ``fire``, dispatched only when it is known to have applied."""
    claim = occurrence("report", fire)
    try:
        epoch = store.epoch()
    except StoreUnavailable:
        return False
    (written,) = settle.create_many(store, [claim], epoch=epoch, tries=1)
    if not written.applied:
        return False  # taken, refused, or unknown: never published on a guess
    job = store.get(claim.ref)
    assert job is not None
    return Dispatcher(store, broker, node=node).dispatch(job, retry=False).outcome is (
        Outcome.PUBLISHED
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("min_replicas", "dispatches"), [(1, 1), (0, 2)])
def test_scenario_71_failover_to_a_replica_that_missed_the_last_claims(
    min_replicas: int, dispatches: int
) -> None:
    with sentinel_group(replicas=2, sentinels=3) as group:
        config = _config(group.url(), min_replicas)
        node_a, node_b = open_store(config), open_store(config)
        broker = Broker()
        try:
            fire = node_a.now().replace(microsecond=0)
            node_a.epoch()  # the epoch exists before the replicas stop: both have it
            group.wait_replicas(2)
            # Given both replicas cut off (paused, their links closed by the master: a paused
            # process would still find the bytes sent to it in its socket once resumed),
            for replica in group.replicas:
                assert replica.pid is not None
                os.kill(replica.pid, signal.SIGSTOP)
            assert group.master.client().client_kill_filter(_type="replica") == 2
            # node A claims (and maybe dispatches) the slot
            a_dispatched = claim_and_dispatch(node_a, fire, broker, "node-a")
            assert a_dispatched is (min_replicas == 0)
            # When the master dies before they resume, and a replica is promoted
            old = group.master
            old.kill()
            for replica in group.replicas:
                assert replica.pid is not None
                os.kill(replica.pid, signal.SIGCONT)
            wait_for("a new master", lambda: group.master_port() != old.port, timeout=60)

            # Then node B finds the slot free on the new master and claims it
            def claimed_by_b() -> bool:
                return claim_and_dispatch(node_b, fire, broker, "node-b")

            wait_for("node B's claim on the new master", claimed_by_b, timeout=60)
            assert len(broker.sent) == dispatches
            duplicates = len(broker.sent) - len({job.ref for job in broker.sent})
            print(f"\nSCENARIO 71 min_replicas={min_replicas}: duplicates={duplicates}")
            assert duplicates == (0 if min_replicas else 1)
        finally:
            node_a.close()
            node_b.close()
