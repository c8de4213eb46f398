"""ExactOnceScheduler on an InMemoryStore with a frozen clock: several nodes, one dispatch."""

from __future__ import annotations

import itertools
import signal
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any

import pytest
from celery import schedules
from celery.schedules import crontab

from celery_exactonce import StoreUnavailable, runtime
from celery_exactonce.beat.entries import occurrence_id
from celery_exactonce.beat.scheduler import ExactOnceScheduler
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.dispatch.messages import GATED_OPTION
from celery_exactonce.observe import metrics
from tests.support.beat_cluster import START, Cluster, every, isolated, refused_at_start


@pytest.fixture(autouse=True)
def _counters_and_signals() -> Iterator[None]:
    with isolated():
        yield


def test_three_nodes_dispatch_each_slot_once() -> None:
    cluster = Cluster({"tick": every(1)})
    cluster.tick_all()
    cluster.run(30)
    fired = cluster.fired("tick")
    assert len(fired) == len(set(fired)) >= 30
    # consecutive seconds, none missing
    assert all((b - a) == timedelta(seconds=1) for a, b in itertools.pairwise(fired))


def test_slots_are_anchored_not_relative_to_start() -> None:
    cluster = Cluster({"five": every(5)}, nodes=1)
    cluster.clock.advance(2.5)
    cluster.run(20)
    assert all(fire.second % 5 == 0 and fire.microsecond == 0 for fire in cluster.fired("five"))


def test_crontab_fires_once_per_matching_minute() -> None:
    cluster = Cluster({"cron": {"task": "plain.t", "schedule": crontab(minute="*/2")}})
    cluster.run(10 * 60, step=10)
    fired = cluster.fired("cron")
    # the slot at start (12:00) is the latest due one on the first tick, then every 2 min
    assert [f.minute for f in fired] == [0, 2, 4, 6, 8, 10]


def test_catch_up_latest_after_downtime_counts_the_skipped() -> None:
    cluster = Cluster({"tick": every(1)}, nodes=2, exactonce_window_lookback=60)
    cluster.run(5)
    before = len(cluster.fired("tick"))
    cluster.clock.advance(2 * 3600)  # every node was down for 2 hours
    cluster.tick_all()
    assert len(cluster.fired("tick")) == before + 1  # only the latest slot
    assert metrics.COUNTERS.get("slot_skipped", where="catchup") >= 59


def test_catch_up_all_and_none_per_entry() -> None:
    cluster = Cluster(
        {
            "all": every(1, exactonce={"catchup": "all"}),
            "none": every(1, exactonce={"catchup": "none"}),
        },
        nodes=2,
        exactonce_window_lookback=30,
        exactonce_catchup_limit=10,
    )
    cluster.tick_all()
    base_all, base_none = len(cluster.fired("all")), len(cluster.fired("none"))
    cluster.clock.advance(20)
    cluster.tick_all()
    assert len(cluster.fired("all")) - base_all == 10  # bounded by catchup_limit
    assert len(cluster.fired("none")) - base_none <= 2  # only the on-time slot(s)


def test_store_loss_skips_unprovable_slots_and_never_duplicates() -> None:
    cluster = Cluster({"tick": every(1), "other": every(1)}, nodes=3)
    cluster.run(5)
    cluster.store.simulate_loss()  # Redis restarted without persistence
    lost_at = cluster.clock.now()
    cluster.run(15)
    fired = cluster.fired("tick")
    assert len(fired) == len(set(fired))
    assert metrics.COUNTERS.get("store_loss_detected", where="epoch") >= 1
    # Nothing at or before the new epoch's birth + max_skew (5 s) was claimed after the loss
    max_skew = timedelta(seconds=5)
    after = [f for f in fired if f > lost_at]
    assert after and min(after) > lost_at + max_skew
    assert metrics.COUNTERS.get("slot_skipped", where="store_loss") >= 2 * 5


def test_a_node_started_after_the_loss_never_reclaims_forgotten_slots() -> None:
    # Given a cluster whose store lost its data, and a node that never saw the old epoch
    cluster = Cluster({"tick": every(1, exactonce={"catchup": "all"})}, nodes=1)
    cluster.run(10)
    cluster.store.simulate_loss()
    cluster.clock.advance(1)
    newcomer = ExactOnceScheduler(cluster.app)
    # When it ticks, with every slot of the last 5 minutes in its window
    newcomer.tick()
    cluster.run(10)
    # Then no slot of the forgotten life was dispatched again
    fired = cluster.fired("tick")
    assert len(fired) == len(set(fired))


def test_a_brand_new_store_starts_claiming_max_skew_after_its_birth() -> None:
    cluster = Cluster({"tick": every(1)}, nodes=2, store_born=START)
    cluster.tick_all()
    cluster.run(10)
    fired = cluster.fired("tick")
    assert fired and min(fired) == START + timedelta(seconds=6)  # max_skew is 5 s
    assert metrics.COUNTERS.get("slot_skipped", where="unprovable") >= 1


def test_a_lost_recent_claim_shows_a_loss_the_epoch_did_not() -> None:
    # Given a node whose recent claims vanish while the epoch survives (a lagging replica)
    cluster = Cluster({"tick": every(1)}, nodes=1)
    cluster.run(5)
    cluster.store.simulate_loss(keep_epoch=True)
    before = len(cluster.fired("tick"))
    # When it ticks again
    cluster.run(10)
    # Then it saw the loss, skipped max_skew of slots, and dispatched nothing twice
    assert metrics.COUNTERS.get("store_loss_detected", where="recheck") == 1
    fired = cluster.fired("tick")
    assert len(fired) == len(set(fired))
    assert len(fired) - before <= 10 - 5


def test_a_node_that_finds_its_claim_forgotten_stops_the_others_reclaiming_it() -> None:
    # Given two nodes holding the epoch; the first wins every claim, the second none
    cluster = Cluster({"a": every(60)}, nodes=2, start=START - timedelta(seconds=1))
    first, second = cluster.nodes
    cluster.tick_all()
    # When the first claims and dispatches the 12:00 slot before the second ticks on
    # it, and the store then forgets that claim but keeps its epoch (a lagging replica)
    cluster.clock.advance(1)
    first.tick()
    assert cluster.fired("a").count(START) == 1
    cluster.store.simulate_loss(keep_epoch=True)
    # and the first node ticks (and finds its claim gone) before the second does
    cluster.clock.advance(1)
    first.tick()
    second.tick()
    # Then the second does not claim the slot again: its claim meets a new epoch
    assert cluster.fired("a").count(START) == 1
    assert metrics.COUNTERS.get("store_loss_detected", where="recheck") == 1
    assert metrics.COUNTERS.get("store_loss_detected", where="epoch") == 1


def test_unknown_schedule_type_is_refused_at_start_naming_the_entry() -> None:

    class Weird(schedules.BaseSchedule):  # type: ignore[misc]
        """A schedule type celery-exactonce cannot derive slots from."""

    with refused_at_start("weird"):
        Cluster({"weird": {"task": "plain.t", "schedule": Weird()}}, nodes=1)


def test_an_entry_of_the_app_that_claims_to_be_beats_own_is_refused_at_start() -> None:
    entry = {**every(1), "options": {"exactonce_internal": True}}
    with refused_at_start("'a'.*'exactonce_internal' is beat's own"):
        Cluster({"a": entry}, nodes=1)


def test_sigterm_during_a_tick_is_held_until_the_tick_ends() -> None:
    # Given a node whose publish receives SIGTERM in the middle of a tick
    cluster = Cluster({"a": every(1), "b": every(1)}, nodes=1)
    node = cluster.nodes[0]
    handler = signal.getsignal(signal.SIGTERM)
    assert callable(handler)
    real_publish = cluster.broker.__call__
    signalled: list[bool] = []

    def publish_then_sigterm(
        job: Job, headers: Mapping[str, Any], extra: Mapping[str, Any]
    ) -> None:
        real_publish(job, headers, extra)
        if not signalled:
            signalled.append(True)
            handler(signal.SIGTERM, None)  # as the signal would, inside the tick

    runtime.runtime_for(cluster.app).dispatcher.publisher = publish_then_sigterm
    cluster.clock.advance(1)
    # When the tick runs, Then it finishes (both entries dispatched) and only then exits
    with pytest.raises(SystemExit):
        node.tick()
    assert {job.entry for job in cluster.broker.sent} == {"a", "b"}
    # Outside a tick, SIGTERM exits at once
    with pytest.raises(SystemExit):
        handler(signal.SIGTERM, None)


def test_a_tick_that_cannot_reach_the_store_claims_nothing_and_notes_the_outage() -> None:
    # Given a node whose store does not answer
    cluster = Cluster({"a": every(1)}, nodes=1)
    rt = runtime.runtime_for(cluster.app)
    real_now = cluster.store.now

    def down() -> Any:
        raise StoreUnavailable("store down")

    cluster.store.now = down  # type: ignore[method-assign]
    # When it ticks
    cluster.clock.advance(1)
    cluster.nodes[0].tick()
    # Then nothing was claimed or published, the failure is counted, and the runtime
    # noted the outage (the reconciler's grace period runs from it)
    assert cluster.broker.sent == [] and rt.store_error_at is not None
    assert metrics.COUNTERS.get("fail_closed", phase="tick_read") == 1
    # And once the store answers, the next tick dispatches the slot inside the window
    cluster.store.now = real_now  # type: ignore[method-assign]
    cluster.clock.advance(1)
    cluster.nodes[0].tick()
    assert cluster.fired("a")


class LostAnswers:
    """Makes the cluster's store apply its next ``method`` call, then raise as if the answer
    was lost; while ``blind``, reads (the writer's read-back) fail too."""

    def __init__(self, cluster: Cluster, method: str) -> None:
        self.blind = False
        self.armed = True
        store = cluster.store
        real_write, real_get = getattr(store, method), store.get

        def write(*args: Any, **kwargs: Any) -> Any:
            result = real_write(*args, **kwargs)
            if self.armed:
                self.armed = False
                raise StoreUnavailable(f"injected: {method} applied, answer lost")
            return result

        def get(*args: Any, **kwargs: Any) -> Any:
            if self.blind:
                raise StoreUnavailable("injected: read-back failed")
            return real_get(*args, **kwargs)

        setattr(store, method, write)
        store.get = get  # type: ignore[method-assign]


@pytest.mark.parametrize("read_back", [True, False], ids=["read-back", "no-read-back"])
def test_a_claim_whose_answer_was_lost_is_claimed_by_nobody_else(read_back: bool) -> None:
    # Given two nodes, and a claim batch the store applies but whose answer is lost
    cluster = Cluster({"a": every(3600)}, nodes=2)
    lost = LostAnswers(cluster, "create_many")
    lost.blind = not read_back
    # When both nodes tick on the slot, and then run for ten minutes (reconcile passes)
    cluster.nodes[0].tick()
    lost.blind = False
    cluster.nodes[1].tick()
    # Then with the read-back the claim is its writer's and dispatched at once; without
    # it the job sits SCHEDULED (no other node takes it) until the reconciler replays it
    assert cluster.fired("a") == ([START] if read_back else [])
    cluster.run(600, step=5)
    assert cluster.fired("a") == [START]
    if not read_back:
        (sent,) = [job for job in cluster.broker.sent if job.entry == "a"]
        replayed = cluster.store.get(sent.ref)
        assert replayed is not None
        assert [h.reason for h in replayed.history if h.dst is State.DISPATCHED] == [
            "reconciler replay"
        ]


@pytest.mark.parametrize("read_back", [True, False], ids=["read-back", "no-read-back"])
def test_a_dispatched_write_whose_answer_was_lost_publishes_at_most_once(read_back: bool) -> None:
    # Given a DISPATCHED write the store applies but whose answer is lost
    cluster = Cluster({"a": every(3600)}, nodes=2)
    lost = LostAnswers(cluster, "transition_many")
    lost.blind = not read_back
    # When the nodes tick on the slot, and then run past dispatch_timeout
    cluster.tick_all()
    lost.blind = False
    # Then the writer that reads its own rev back publishes once; one that cannot
    # publishes nothing, and the reconciler settles the (plain) job visibly
    assert cluster.fired("a") == ([START] if read_back else [])
    cluster.run(600, step=5)
    assert cluster.fired("a") == ([START] if read_back else [])
    if not read_back:
        ref = JobRef.occurrence(occurrence_id(cluster.store.namespace, "a", START))
        job = cluster.store.get(ref)
        assert job is not None and job.state is State.TIMEOUT and job.reason == "unconfirmed"


def test_a_tick_longer_than_the_window_follows_the_catch_up_policy() -> None:
    # Given one node, entries every second with the default catch-up (latest) and one
    # with "all", a 60 s window, and a tick that takes 90 s of store time (its claim
    # write is that slow)
    cluster = Cluster(
        {"latest": every(1), "all": every(1, exactonce={"catchup": "all"})},
        nodes=1,
        exactonce_window_lookback=60,
    )
    cluster.run(5)
    metrics.COUNTERS.reset()
    store, real = cluster.store, cluster.store.create_many
    slow = {"left": 1}

    def create_many(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        if slow["left"]:
            slow["left"] -= 1
            cluster.clock.advance(90)
        return result

    store.create_many = create_many  # type: ignore[method-assign]
    cluster.clock.advance(1)
    cluster.nodes[0].tick()  # the long one
    fired = {name: cluster.fired(name) for name in ("latest", "all")}
    # When the next ticks come
    cluster.run(3)
    # Then "latest" took only the newest slot after the long tick; the ones it left
    # behind (out of the window, or overtaken) are counted, not run; "all" caught up
    # what is still in the window; no slot of either ran twice
    latest, every_slot = cluster.fired("latest"), cluster.fired("all")
    assert len(latest) == len(set(latest)) and len(every_slot) == len(set(every_slot))
    assert len(latest) == len(fired["latest"]) + 3
    assert len(every_slot) >= len(fired["all"]) + 60
    assert metrics.COUNTERS.get("slot_skipped", where="window") >= 2 * 30  # both entries
    assert metrics.COUNTERS.get("slot_skipped", where="catchup") >= 59  # "latest" only


@pytest.mark.parametrize(
    "at",
    ["now", "watermarks", "create_many", "transition_many", "claim_due", "publish"],
)
def test_sigterm_at_any_step_of_a_tick_leaves_no_claim_behind(at: str) -> None:
    # Given a node with two entries due and a delayed job due, and SIGTERM arriving
    # right after the tick's first call of ``at``
    cluster = Cluster({"a": every(1), "b": every(1)}, nodes=1)
    node = cluster.nodes[0]
    handler = signal.getsignal(signal.SIGTERM)
    assert callable(handler)
    store = cluster.store
    delayed = NewJob(
        JobRef.submitted("delayed-1"),
        "plain.t",
        State.PENDING,
        node="test",
        options={GATED_OPTION: False},
        run_at=store.now(),
    )
    assert store.create(delayed).created
    cluster.clock.advance(1)
    fired: list[str] = []

    def after_first(call: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            result = call(*args, **kwargs)
            if not fired:
                fired.append(at)
                handler(signal.SIGTERM, None)  # as the signal would, inside the tick
            return result

        return wrapped

    if at == "publish":
        dispatcher = runtime.runtime_for(cluster.app).dispatcher
        dispatcher.publisher = after_first(dispatcher.publisher)
    else:
        setattr(store, at, after_first(getattr(store, at)))
    # When the tick runs, Then it ends, and only then beat exits
    with pytest.raises(SystemExit):
        node.tick()
    assert fired == [at]
    # and whatever the tick claimed was dispatched: no job is left SCHEDULED, and the
    # slots were dispatched; the delayed job was dispatched or never claimed
    left = store.list_stale(State.SCHEDULED, 0, 100)
    assert left == [], [job.ref for job in left]
    assert {job.entry for job in cluster.broker.sent} >= {"a", "b"}
    assert store.get(delayed.ref).state in (State.PENDING, State.PUBLISHED)  # type: ignore[union-attr]


def test_skipped_slots_are_recorded_in_the_store_once_per_entry_and_tick() -> None:
    # Given two entries that skip what they miss, on two nodes
    schedule = {
        "minutely": {**every(60), "options": {"exactonce": {"catchup": "none"}}},
        "hourly": {**every(3600), "options": {"exactonce": {"catchup": "none"}}},
    }
    with isolated():
        cluster = Cluster(schedule, nodes=2)
        cluster.tick_all()
        # When every node was down for ten minutes
        cluster.clock.advance(600)
        cluster.tick_all()
        # Then the store holds a record per entry, reason and tick of each node that
        # skipped slots: the nine missed minutes, older than the window or caught up past
        records = cluster.store.skipped()
        assert {r.entry for r in records} == {"minutely"}
        first_node = [(r.where, r.count) for r in reversed(records)][:2]
        assert sorted(first_node) == [("catchup", 4), ("window", 5)]
        assert all(r.last - r.first == timedelta(minutes=r.count - 1) for r in records)
        assert {r.node for r in records} == {cluster.nodes[0]._runtime.node}
