"""PostgreSQL failover on real servers: what a promoted standby holds of the acknowledged writes.

A private primary and its streaming standby (:mod:`tests.integration.pg_servers`).
Beat A claims a batch of occurrences through the SQL store (``claims.claim``:
``create_many`` under the store epoch, as beat does), marks half of them
``DISPATCHED`` (the dispatcher's CAS) and creates delayed jobs; the primary is
SIGKILLed right after the acknowledgements and the standby promoted. Beat B
then claims the same slots on the new primary.

* Synchronous standby (``synchronous_standby_names = 'FIRST 1 (standby)'``,
  ``synchronous_commit = on``), its replay paused so that it shows none of the
  writes when the primary dies: every acknowledged write is on it once
  promoted, and every claim of B is *taken*. If the standby stops streaming, a
  claim is never acknowledged: A publishes nothing, and B's claim is the only one.
* Asynchronous standby, its stream cut before the writes (the control): the
  primary acknowledged every write and the promoted standby has none of them;
  B wins every slot A had won, so each would run twice.
* A libpq multi-host URL (``?host=H:P&host=H:P&target_session_attrs=read-write``):
  one store keeps working across the failover; an operation in between fails
  as ``StoreUnavailable`` (credentials redacted), the next one reaches the new primary.

The asynchronous standby's stream is cut, not its replay paused: a promoted
standby replays all the WAL it received while paused, so a paused standby
loses nothing.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta

import pytest
from celery import Celery

from celery_exactonce import ExactOnceConfig, StoreUnavailable, open_store
from celery_exactonce.beat import claims
from celery_exactonce.beat.claims import Claimed
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import Transition
from celery_exactonce.stores.base import StateStore
from tests.benchmarks.claims import occurrences
from tests.integration.pg_servers import PgServer, pg_pair, wait_for
from tests.support.helpers import task_job

pytestmark = pytest.mark.timeout(120)

#: Occurrences beat A claims (one batch), of which half are dispatched; delayed jobs.
CLAIMS, JOBS = 200, 50
NAMESPACE = "standby"
_SCHEDULED = frozenset({State.SCHEDULED})


@contextmanager
def _opened(url: str) -> Iterator[StateStore]:
    """The store on ``url``, set up as a node opens it, closed at the end."""
    app = Celery("pg-standby", set_as_current=False)
    app.conf.exactonce_store_url = url
    app.conf.exactonce_namespace = NAMESPACE
    app.conf.exactonce_store_timeout = 2.0
    store = open_store(ExactOnceConfig.from_app(app))
    try:
        yield store
    finally:
        store.close()


@dataclasses.dataclass
class Acknowledged:
    """What beat A wrote and the primary acknowledged."""

    epoch: str
    fire: datetime
    #: Each record as the acknowledgement left it: claimed, dispatched, or a delayed job.
    records: dict[JobRef, tuple[State, str]]


def _claim(store: StateStore, fire: datetime) -> Claimed:
    """One beat's claims of the :data:`CLAIMS` slots at ``fire`` (its own revs)."""
    batch = occurrences(store, CLAIMS, fire)
    return claims.claim(store, batch, epoch=store.epoch(), now=store.now())


def _write(store: StateStore) -> Acknowledged:
    """Beat A's claims, half of them dispatched, and delayed jobs; each one acknowledged."""
    epoch = store.epoch()
    fire = store.now().replace(microsecond=0)
    claimed = _claim(store, fire)
    assert len(claimed.won) == CLAIMS, claimed
    records = {job.ref: (job.state, job.rev) for _, job in claimed.won}
    published = [
        (job.ref, Transition(State.DISPATCHED, _SCHEDULED, node="a", reason="sent", rev=job.rev))
        for _, job in claimed.won[: CLAIMS // 2]
    ]
    for result in store.transition_many(published):
        assert result.applied and result.job is not None, result.status
        records[result.job.ref] = (result.job.state, result.job.rev)
    delayed = [task_job(state=State.PENDING, run_at=fire + timedelta(hours=1)) for _ in range(JOBS)]
    for new, created in zip(delayed, store.create_many(delayed), strict=True):
        assert created.created, created.status
        records[new.ref] = (new.state, new.rev)
    return Acknowledged(epoch, fire, records)


def _kept(store: StateStore, acked: Acknowledged) -> dict[JobRef, tuple[State, str]]:
    """The acknowledged records ``store`` holds as they were acknowledged."""
    found: dict[JobRef, Job | None] = {ref: store.get(ref) for ref in acked.records}
    return {
        ref: (job.state, job.rev)
        for ref, job in found.items()
        if job is not None and acked.records[ref] == (job.state, job.rev)
    }


def _rows(server: PgServer) -> int:
    """The records of :data:`NAMESPACE` that ``server`` shows."""
    query = "SELECT count(*) FROM exactonce_jobs WHERE namespace = %s"
    return int(server.query(query, (NAMESPACE,))[0][0])


def _after_failover(new: PgServer, acked: Acknowledged, label: str) -> tuple[int, Claimed]:
    """On the promoted ``new``: how many acknowledged records it kept, and beat B's claims.

    Also checks that the store's epoch is still the one A claimed under.
    """
    with _opened(new.url()) as store:
        kept = _kept(store, acked)
        assert store.epoch() == acked.epoch
        second = _claim(store, acked.fire)
    print(
        f"\nPG {label}: {len(acked.records)} records acknowledged ({CLAIMS} claims,"
        f" {CLAIMS // 2} dispatched, {JOBS} delayed jobs), {len(kept)} on the promoted standby"
        f" as acknowledged; beat B: {len(second.won)} won, {len(second.taken)} taken"
    )
    return len(kept), second


def test_a_promoted_synchronous_standby_keeps_every_acknowledged_claim() -> None:
    with pg_pair(sync=True) as pair, _opened(pair.primary.url()) as store:
        wait_for("the standby caught up", pair.caught_up)
        # Given a synchronous standby that receives WAL but applies none of it (it lags),
        pair.pause_replay()
        # beat A's claims, dispatches and delayed jobs, acknowledged by the primary,
        acked = _write(store)
        # none of which the standby shows yet
        assert _rows(pair.standby) == 0
        # When the primary is SIGKILLed right after, and the standby promoted
        new = pair.fail_over()
        # Then every acknowledged record is there, as acknowledged, under the same epoch,
        kept, second = _after_failover(new, acked, "synchronous standby, replay paused")
        assert kept == len(acked.records)
        # and beat B's claims of the same slots all lose
        assert (len(second.won), len(second.taken)) == (0, CLAIMS)


def test_a_synchronous_standby_that_stopped_streaming_leaves_the_claims_unacknowledged() -> None:
    with pg_pair(sync=True) as pair, _opened(pair.primary.url()) as store:
        fire = store.now().replace(microsecond=0)
        store.epoch()
        wait_for("the standby caught up", pair.caught_up)
        # Given a synchronous standby that no longer streams
        pair.cut_stream()
        # When beat A claims, its commit waits for the standby
        answer: list[Claimed] = []
        claiming = threading.Thread(target=lambda: answer.append(_claim(store, fire)))
        claiming.start()
        wait_for("A's claims waiting for the standby", lambda: pair.commits_waiting() > 0)
        assert answer == []
        # and the primary dies before the standby confirms
        pair.primary.kill()
        claiming.join(timeout=60)
        assert not claiming.is_alive()
        # Then A won nothing, so published nothing: its claims stay undecided
        (claimed,) = answer
        assert (len(claimed.won), len(claimed.failed)) == (0, CLAIMS)
        pair.standby.promote()
        # and B, on the promoted standby, is the one beat that dispatches each slot
        with _opened(pair.standby.url()) as promoted:
            second = _claim(promoted, fire)
        assert (len(second.won), len(second.taken)) == (CLAIMS, 0)


def test_a_promoted_asynchronous_standby_loses_acknowledged_claims() -> None:
    with pg_pair(sync=False) as pair, _opened(pair.primary.url()) as store:
        store.epoch()
        wait_for("the standby caught up", pair.caught_up)
        # Given an asynchronous standby that receives nothing more (a lagging one, frozen)
        pair.cut_stream()
        # When beat A's writes are acknowledged by the primary alone, and it is SIGKILLed
        acked = _write(store)
        new = pair.fail_over()
        # Then the promoted standby has none of them, though its epoch is the same,
        kept, second = _after_failover(new, acked, "asynchronous standby, stream cut")
        assert kept == 0
        # and beat B wins every slot A had won: each would be dispatched twice
        assert (len(second.won), len(second.taken)) == (CLAIMS, 0)


def test_a_store_on_a_multi_host_url_follows_the_promoted_standby() -> None:
    with pg_pair(sync=True) as pair:
        url = pair.multi_host_url("postgresql").replace("postgres@", "postgres:s3cret@")
        with _opened(url) as store:
            # Given a store on both servers, connected to the one that takes writes
            acked = _write(store)
            # When the primary is SIGKILLed, an operation before the promotion fails
            pair.primary.kill()
            with pytest.raises(StoreUnavailable) as lost:
                store.get(next(iter(acked.records)))
            assert "s3cret" not in str(lost.value)
            hosts = f"host=127.0.0.1:{pair.primary.port}&host=127.0.0.1:{pair.standby.port}"
            assert hosts in str(lost.value)
            # Then, the standby promoted, the same store works on it with every record kept
            pair.standby.promote()
            assert _kept(store, acked) == acked.records
            assert (len(_claim(store, acked.fire).taken), store.epoch()) == (CLAIMS, acked.epoch)
