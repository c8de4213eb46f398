"""Stale listing, due claims, expiry and leases, on every store."""

from __future__ import annotations

from datetime import datetime, timedelta

from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.stores.base import StateStore
from tests.support.backends import StoreFactory
from tests.support.helpers import NODE, occurrence, poll, task_job, to, wait_store_past


def test_list_stale_oldest_first_bounded_by_state_and_age(store: StateStore) -> None:
    refs = []
    for i in range(5):
        result = store.create(task_job(f"s{i}"))
        assert result.job is not None
        refs.append(result.job.ref)
        wait_store_past(store, result.job.touched_at)  # distinct touch times
    store.create(task_job("p", state=State.PENDING, run_at=store.now()))
    stale = store.list_stale(State.SCHEDULED, older_than=0, limit=3)
    assert [job.ref for job in stale] == refs[:3]
    assert [job.ref for job in store.list_stale(State.SCHEDULED, 0, 100)] == refs
    assert store.list_stale(State.SCHEDULED, older_than=3600, limit=100) == []
    assert [j.ref for j in store.list_stale(State.PENDING, 0, 10)] == [JobRef.submitted("p")]
    assert store.list_stale(State.RUNNING, 0, 10) == []


def test_list_stale_follows_transitions_and_heartbeats(store: StateStore) -> None:
    a, b = task_job("a"), task_job("b")
    store.create(a)
    store.create(b)
    store.transition(a.ref, to(State.DISPATCHED, State.SCHEDULED))
    assert [j.ref for j in store.list_stale(State.SCHEDULED, 0, 10)] == [b.ref]
    assert [j.ref for j in store.list_stale(State.DISPATCHED, 0, 10)] == [a.ref]
    store.transition(a.ref, to(State.RUNNING, State.DISPATCHED, attempt=0, new_run_id="r"))
    store.transition(b.ref, to(State.DISPATCHED, State.SCHEDULED))
    store.transition(b.ref, to(State.RUNNING, State.DISPATCHED, attempt=0, new_run_id="r"))
    # A heartbeat moves a job to the back of the staleness order
    job_b = store.get(b.ref)
    assert job_b is not None
    wait_store_past(store, job_b.touched_at)
    assert store.heartbeat(a.ref, "r")
    assert [j.ref for j in store.list_stale(State.RUNNING, 0, 10)] == [b.ref, a.ref]
    store.transition(a.ref, to(State.SUCCEEDED, State.RUNNING, run_id="r"))
    assert [j.ref for j in store.list_stale(State.RUNNING, 0, 10)] == [b.ref]
    assert [j.ref for j in store.list_stale(State.SUCCEEDED, 0, 10)] == [a.ref]


def tied(store: StateStore, ids: list[str]) -> list[Job]:
    """SCHEDULED jobs of ``ids`` that share one ``touched_at`` (claimed in one ``claim_due``)."""
    due = store.now() - timedelta(hours=1)
    for job_id in ids:
        store.create(task_job(job_id, state=State.PENDING, run_at=due))
    claimed = store.claim_due(len(ids), node=NODE)
    # one claim per shard: a sharded store's shards each claim at their own time
    shards = getattr(store, "shards", 1)
    assert len(claimed) == len(ids) and len({job.touched_at for job in claimed}) <= shards
    wait_store_past(store, max(job.touched_at for job in claimed))
    return claimed


def past(jobs: list[Job], cursor: tuple[datetime, JobRef]) -> list[JobRef]:
    """The refs of ``jobs`` strictly after the keyset ``cursor``, in listing order."""
    key = (cursor[0], str(cursor[1]))
    return [r for r in in_listing_order(jobs) if (by_ref(jobs, r), str(r)) > key]


def by_ref(jobs: list[Job], ref: JobRef) -> datetime:
    return next(job.touched_at for job in jobs if job.ref == ref)


def in_listing_order(jobs: list[Job]) -> list[JobRef]:
    return [job.ref for job in sorted(jobs, key=lambda job: (job.touched_at, str(job.ref)))]


#: Ids whose code-point order is neither their creation order nor a locale's order.
TIED_IDS = ["b", "B", "a", "ä", "a-1", "a1", "Z", "€", "\U0001d11e", "a 1", "aa"]


def test_list_stale_pages_through_ties_on_touched_at_once_each_in_order(
    store: StateStore,
) -> None:
    # Given two groups of jobs, each sharing a touched_at, and a lone job between them
    first = tied(store, TIED_IDS)
    lone = store.create(task_job("m")).job
    assert lone is not None
    wait_store_past(store, lone.touched_at)
    second = tied(store, [f"{job_id}2" for job_id in TIED_IDS])
    expected = in_listing_order([*first, lone, *second])
    # When they are listed 4 at a time, each page after the last job of the one before
    pages, after = [], None
    while True:
        page = store.list_stale(State.SCHEDULED, 0, 4, after=after)
        pages.append([job.ref for job in page])
        if len(page) < 4:
            break
        after = (page[-1].touched_at, page[-1].ref)
    # Then every job came exactly once, in (touched_at, ref) order, in full pages but the last
    assert [ref for page in pages for ref in page] == expected
    assert [len(page) for page in pages] == [4] * (len(expected) // 4) + [len(expected) % 4]
    # and one listing of them all agrees
    assert [job.ref for job in store.list_stale(State.SCHEDULED, 0, 100)] == expected


def test_list_stale_after_a_cursor_that_is_no_job(store: StateStore) -> None:
    # Given jobs sharing a touched_at
    group = tied(store, TIED_IDS)
    at = min(job.touched_at for job in group)
    # When listed after cursors at that time with refs no job has
    # Then the jobs strictly after the cursor's ref come, in order
    after_a = store.list_stale(State.SCHEDULED, 0, 100, after=(at, JobRef.submitted("a0")))
    assert [job.ref for job in after_a] == past(group, (at, JobRef.submitted("a0")))
    # an occurrence ref sorts before every task ref of the same time
    early = store.list_stale(State.SCHEDULED, 0, 100, after=(at, JobRef.occurrence("zzz")))
    expected = past(group, (at, JobRef.occurrence("zzz")))
    assert [job.ref for job in early] == expected == in_listing_order(group)
    # and the limit holds after a cursor too
    page = store.list_stale(State.SCHEDULED, 0, 2, after=(at, JobRef.occurrence("zzz")))
    assert [job.ref for job in page] == expected[:2]


def test_list_stale_after_the_end_is_empty(store: StateStore) -> None:
    # Given stale jobs
    group = tied(store, ["x", "y"])
    last = max(group, key=lambda job: (job.touched_at, str(job.ref)))
    # When listed after the last one, or after a time past them all
    # Then nothing comes
    assert store.list_stale(State.SCHEDULED, 0, 10, after=(last.touched_at, last.ref)) == []
    later = (store.now() + timedelta(hours=1), JobRef.submitted("a"))
    assert store.list_stale(State.SCHEDULED, 0, 10, after=later) == []
    # and a cursor before them all still keeps the age bound and the limit
    before = (last.touched_at - timedelta(hours=1), JobRef.submitted("z"))
    assert store.list_stale(State.SCHEDULED, 3600, 10, after=before) == []
    assert len(store.list_stale(State.SCHEDULED, 0, 1, after=before)) == 1
    assert store.list_stale(State.SCHEDULED, 0, 0, after=before) == []


def test_claim_due_in_run_at_order(store: StateStore) -> None:
    now = store.now()
    for i, minutes in enumerate([3, 1, 2]):
        store.create(
            task_job(f"d{i}", state=State.PENDING, run_at=now - timedelta(minutes=minutes))
        )
    store.create(task_job("future", state=State.PENDING, run_at=now + timedelta(hours=1)))
    first = store.claim_due(2, node=NODE)
    assert [j.ref.id for j in first] == ["d0", "d2"]
    assert all(j.state is State.SCHEDULED and j.node == NODE for j in first)
    assert all(j.history[-1].src is State.PENDING for j in first)
    assert len({j.rev for j in first}) == 2
    second = store.claim_due(10, node=NODE)
    assert [j.ref.id for j in second] == ["d1"]
    assert store.claim_due(10, node=NODE) == []
    assert [j.ref.id for j in store.list_stale(State.PENDING, 0, 10)] == ["future"]
    # A claimed job is a SCHEDULED record like any other
    got = store.get(JobRef.submitted("d1"))
    assert got is not None and got == second[0]


def test_released_and_cancelled_pending_jobs(store: StateStore) -> None:
    past = store.now() - timedelta(seconds=1)
    store.create(task_job("rel", state=State.PENDING, run_at=past))
    store.create(task_job("can", state=State.PENDING, run_at=past))
    cancel = store.get(JobRef.submitted("can"))
    assert cancel is not None
    assert store.transition(cancel.ref, to(State.CANCELLED, State.PENDING, rev=cancel.rev)).applied
    (claimed,) = store.claim_due(10, node=NODE)
    assert claimed.ref.id == "rel"
    # SIGTERM mid-batch: the sweeper releases its claim back to PENDING, due again
    release = to(State.PENDING, State.SCHEDULED, rev=claimed.rev, run_at=claimed.run_at)
    assert store.transition(claimed.ref, release).applied
    assert [j.ref.id for j in store.claim_due(10, node=NODE)] == ["rel"]


def test_only_terminal_records_expire(store_factory: StoreFactory) -> None:
    store = store_factory(retention=0.05)
    old = store.now() - timedelta(days=30)
    live = [
        task_job("live-pending", state=State.PENDING, run_at=old),
        task_job("live-scheduled"),
        task_job("live-running", state=State.RUNNING),
    ]
    for new in live:
        store.create(new)
    done = task_job("done")
    store.create(done)
    store.transition(done.ref, to(State.CANCELLED, State.SCHEDULED))
    # A terminal occurrence whose slot lies in the future is kept until slot + retention
    future = occurrence("later", store.now() + timedelta(hours=1))
    store.create(future)
    store.transition(future.ref, to(State.CANCELLED, State.SCHEDULED))
    poll(lambda: store.purge_expired(100) or store.get(done.ref) is None)
    assert store.get(done.ref) is None
    assert store.purge_expired(100) == 0
    for new in [*live, future]:
        assert store.get(new.ref) is not None, new.ref
    assert store.list_stale(State.CANCELLED, 0, 10)[0].ref == future.ref


def test_purge_is_bounded(store_factory: StoreFactory) -> None:
    store = store_factory(retention=0.01)
    for i in range(5):
        new = task_job(f"t{i}")
        store.create(new)
        store.transition(new.ref, to(State.CANCELLED, State.SCHEDULED))
    job = store.get(JobRef.submitted("t4"))
    assert job is not None and job.terminal_at is not None
    poll(lambda: store.now() - job.terminal_at >= timedelta(seconds=0.05))  # type: ignore[operator]
    assert store.purge_expired(2) == 2
    assert store.purge_expired(10) == 3
    assert store.purge_expired(10) == 0


def test_lease_acquire_renew_release(store: StateStore) -> None:
    assert store.acquire_lease("recon", "t1", 30)
    assert not store.acquire_lease("recon", "t2", 30)
    assert store.acquire_lease("recon", "t1", 30)  # the holder re-acquiring renews
    assert store.renew_lease("recon", "t1", 30)
    assert not store.renew_lease("recon", "t2", 30)
    assert not store.release_lease("recon", "t2")  # a stale token releases nothing
    assert not store.acquire_lease("recon", "t2", 30)
    assert store.release_lease("recon", "t1")
    assert not store.release_lease("recon", "t1")
    assert not store.renew_lease("recon", "t1", 30)
    assert store.acquire_lease("recon", "t2", 30)
    assert store.acquire_lease("other", "t1", 30)  # leases are per name


def test_expired_lease_passes_on_and_the_old_token_is_dead(store: StateStore) -> None:
    assert store.acquire_lease("recon", "old", 0.05)
    poll(lambda: store.acquire_lease("recon", "new", 30))
    assert not store.renew_lease("recon", "old", 30)
    assert not store.release_lease("recon", "old")
    assert store.renew_lease("recon", "new", 30)


def test_namespaces_are_isolated(store_factory: StoreFactory) -> None:
    a = store_factory("ns-a-" + store_factory.namespace)
    b = store_factory("ns-b-" + store_factory.namespace)
    new = task_job("shared-id")
    assert a.create(new).created
    assert b.create(new).created
    assert a.transition(new.ref, to(State.CANCELLED, State.SCHEDULED)).applied
    got = b.get(new.ref)
    assert got is not None and got.state is State.SCHEDULED
    assert a.epoch() != b.epoch()
    fire = a.now()
    assert a.create(occurrence("e", fire)).created
    assert b.watermark("e") is None
    assert a.acquire_lease("l", "x", 30) and b.acquire_lease("l", "y", 30)


def test_store_time_is_utc_and_moves(store: StateStore) -> None:
    first = store.now()
    assert first.utcoffset() == timedelta(0)
    poll(lambda: store.now() > first)
