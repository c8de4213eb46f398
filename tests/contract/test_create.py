"""create-if-absent, the epoch and the watermark: the same bodies on every store."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest

from celery_exactonce.core import exceptions, payload
from celery_exactonce.core.jobs import CreateStatus
from celery_exactonce.core.refs import JobRef, Space, epoch_born
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob
from celery_exactonce.stores.base import StateStore
from tests.support.backends import StoreFactory, lose_data
from tests.support.helpers import NODE, occurrence, poll, task_job, to


def test_create_then_read_back(store: StateStore) -> None:
    # Given a new SCHEDULED job
    new = task_job(args=(1, [2, 3], {"k": None}), kwargs={"name": "ü", "n": 1.5})
    # When it is created
    result = store.create(new)
    # Then this call created it, and reading it back gives the same record
    assert result.status is CreateStatus.CREATED
    job = store.get(new.ref)
    assert job == result.job
    assert job is not None
    assert (job.state, job.rev, job.attempt, job.run_id) == (State.SCHEDULED, new.rev, 0, None)
    assert (job.task, job.args, job.kwargs) == ("tasks.add", [1, [2, 3], {"k": None}], new.kwargs)
    assert job.options == {"queue": "celery"}
    assert job.node == NODE and job.dispatches == 0 and job.terminal_at is None
    assert [(h.src, h.dst, h.rev) for h in job.history] == [(None, State.SCHEDULED, new.rev)]
    assert abs(job.created_at - store.now()) < timedelta(seconds=5)


def test_kombu_typed_arguments_are_stored_and_read_back_as_kombu_encodes_them(
    store: StateStore,
) -> None:
    """datetime, Decimal, UUID and bytes arguments, which plain Celery's JSON carries.

    Fails before the fix: ``InvalidPayload`` (not JSON), so a beat entry or an
    ``apply_async`` with such an argument could not be stored.
    """
    args = (datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=timezone.utc), Decimal("0.10"), b"\xff\x00")
    kwargs = {"id": uuid.UUID(int=7), "naive": datetime(2026, 1, 2), "text": "ü"}
    new = task_job(args=args, kwargs=kwargs)
    assert store.create(new).created
    job = store.get(new.ref)
    assert job is not None and (job.args, job.kwargs) == (new.args, new.kwargs)
    assert payload.decode_payload(job.args) == list(args)
    assert payload.decode_payload(job.kwargs) == kwargs


def test_second_create_reports_existing(store: StateStore) -> None:
    first = task_job("same-id")
    store.create(first)
    # A retried create (same rev) and a competing one (another rev) both see EXISTS
    again = store.create(first)
    other = store.create(task_job("same-id", args=(9,)))
    assert again.status is CreateStatus.EXISTS and other.status is CreateStatus.EXISTS
    assert again.job is not None and again.job.rev == first.rev  # the retry learns it was its own
    assert other.job is not None and other.job.args == [1, 2]  # nothing overwritten


def test_missing_job_reads_none(store: StateStore) -> None:
    assert store.get(JobRef.submitted("nope")) is None


def test_occurrence_and_task_ids_are_separate_key_spaces(store: StateStore) -> None:
    fire = store.now().replace(microsecond=0)
    occ = occurrence("report", fire)
    # A caller choosing the occurrence's id cannot pre-empt the beat slot
    assert store.create(task_job(occ.ref.id)).created
    assert store.create(occ).created
    task_side = store.get(JobRef(Space.SUBMITTED, occ.ref.id))
    occ_side = store.get(occ.ref)
    assert task_side is not None and occ_side is not None
    assert (task_side.task, occ_side.task) == ("tasks.add", "tasks.tick")


@pytest.mark.parametrize(
    "job_id", ["a:b:c", "x@2024-01-01T00:00:00+00:00", "weird/\\%*?[]{}'\"", "é", "0" * 200]
)
def test_ids_with_separators_round_trip(store: StateStore, job_id: str) -> None:
    new = task_job(job_id)
    assert store.create(new).created
    job = store.get(JobRef.submitted(job_id))
    assert job is not None and job.ref.id == job_id


def test_delayed_and_adopted_jobs_keep_their_fields(store: StateStore) -> None:
    run_at = store.now() + timedelta(hours=1)
    pending = store.create(task_job(state=State.PENDING, run_at=run_at)).job
    running = store.create(task_job(state=State.RUNNING)).job
    assert pending is not None and pending.run_at == run_at.replace(microsecond=run_at.microsecond)
    assert running is not None and running.run_id and running.heartbeat_at is not None


def test_epoch_is_stable_and_checked(store: StateStore) -> None:
    before = store.now()
    epoch = store.epoch()
    assert store.epoch() == epoch
    # It carries its birth time on the store clock (the store-loss floor of beat)
    born = epoch_born(epoch)
    assert born is not None and before <= born <= store.now()
    # A create that holds another epoch writes nothing
    wrong = store.create(task_job("e1"), epoch="not-the-epoch")
    assert wrong.status is CreateStatus.EPOCH_MISMATCH and wrong.epoch == epoch
    assert store.get(JobRef.submitted("e1")) is None
    assert store.create(task_job("e1"), epoch=epoch).created


def test_an_epoch_is_replaced_only_while_it_is_the_current_one(store: StateStore) -> None:
    old = store.epoch()
    before = store.now()
    # When a node replaces the epoch it holds
    new = store.epoch(replace=old)
    # Then a new life begins now: claims with the old epoch are refused from here on
    assert new != old and store.epoch() == new
    born = epoch_born(new)
    assert born is not None and before <= born <= store.now()
    refused = store.create(task_job("ep-old"), epoch=old)
    assert refused.status is CreateStatus.EPOCH_MISMATCH and refused.epoch == new
    assert store.create(task_job("ep-new"), epoch=new).created
    # and a second node replacing the same old epoch changes nothing (one winner)
    assert store.epoch(replace=old) == new
    assert store.epoch(replace="never-an-epoch") == new
    assert store.epoch() == new


def test_store_loss_is_detected_by_the_next_claim(store_factory: StoreFactory) -> None:
    # Given a node that claimed a slot and remembers the epoch
    store = store_factory()
    epoch = store.epoch()
    fire = store.now().replace(microsecond=0)
    assert store.create(occurrence("e", fire), epoch=epoch).created
    # When the store loses its data (a restart without persistence)
    lose_data(store)
    # Then the next claim, with the remembered epoch, is refused and writes nothing
    result = store.create(occurrence("e", fire + timedelta(seconds=1)), epoch=epoch)
    assert result.status is CreateStatus.EPOCH_MISMATCH
    assert store.get(occurrence("e", fire + timedelta(seconds=1)).ref) is None
    # and the store starts a new epoch
    assert store.epoch() != epoch


def test_watermark_is_never_passed_by_an_older_slot(store: StateStore) -> None:
    t0 = store.now().replace(microsecond=0)
    t1, t2 = t0 + timedelta(seconds=1), t0 + timedelta(seconds=2)
    assert store.watermark("wm") is None
    assert store.create(occurrence("wm", t2)).created
    assert store.watermark("wm") == t2
    # An older slot with no record is below the watermark: decided, never claimed
    below = store.create(occurrence("wm", t1))
    assert below.status is CreateStatus.BELOW_WATERMARK and below.job is None
    assert store.get(occurrence("wm", t1).ref) is None
    # The claimed slot itself reports EXISTS; the watermark does not move back
    assert store.create(occurrence("wm", t2)).status is CreateStatus.EXISTS
    assert store.watermark("wm") == t2
    # Watermarks are per entry
    assert store.create(occurrence("other", t1)).created


def test_watermark_decides_after_the_record_expired(store_factory: StoreFactory) -> None:
    # A monthly slot whose record expired (short retention) is still never claimed again
    store = store_factory(retention=0.05)
    fire = store.now() - timedelta(days=1)
    new = occurrence("monthly", fire)
    assert store.create(new).created
    assert store.transition(new.ref, to(State.CANCELLED, State.SCHEDULED)).applied
    poll(lambda: store.purge_expired(10) or store.get(new.ref) is None)
    assert store.get(new.ref) is None
    assert store.create(new).status is CreateStatus.BELOW_WATERMARK


def test_invalid_new_jobs_are_refused_before_any_write(store: StateStore) -> None:
    with pytest.raises(exceptions.InvalidPayload, match="args"):
        task_job("bad", args=(object(),))
    with pytest.raises(exceptions.InvalidPayload, match="kwargs"):
        task_job("bad", kwargs={"x": float("nan")})
    with pytest.raises(exceptions.InvalidPayload, match="job id"):
        task_job("bad\nid")
    with pytest.raises(exceptions.InvalidRequest, match="run_at"):
        task_job("bad", state=State.PENDING)
    with pytest.raises(exceptions.InvalidPayload, match="timezone-aware"):
        occurrence("e", store.now().replace(tzinfo=None))
    with pytest.raises(exceptions.InvalidRequest, match="cannot be created"):
        NewJob(JobRef.submitted("bad"), "t", State.DISPATCHED, node=NODE)
    assert store.get(JobRef.submitted("bad")) is None


def test_create_many_is_create_in_turn(store: StateStore) -> None:
    t0 = store.now().replace(microsecond=0)
    t1, t2 = t0 + timedelta(seconds=1), t0 + timedelta(seconds=2)
    existing = store.create(task_job("cm-existing")).job
    assert existing is not None
    # Given a batch mixing new occurrences, an existing job and a slot the batch itself passes
    batch = [
        occurrence("cm-b", t1),
        occurrence("cm-a", t1),
        occurrence("cm-a", t2),
        task_job("cm-existing"),
        occurrence("cm-a", t0),
    ]
    results = store.create_many(batch)
    # Then each result is what create would have said, in the batch's order
    assert [r.status for r in results] == [
        CreateStatus.CREATED,
        CreateStatus.CREATED,
        CreateStatus.CREATED,
        CreateStatus.EXISTS,
        CreateStatus.BELOW_WATERMARK,
    ]
    assert results[3].job is not None and results[3].job.rev == existing.rev
    assert store.watermark("cm-a") == t2 and store.watermark("cm-b") == t1
    assert store.create_many([]) == []


def test_a_brief_batch_answers_what_create_in_turn_answers_for_slots_decided_before_it(
    store: StateStore,
) -> None:
    """A second node's claims: most slots are decided before its batch comes."""
    t0 = store.now().replace(microsecond=0)
    t1, t2 = t0 + timedelta(seconds=1), t0 + timedelta(seconds=2)
    # Given one entry claimed at t1, another at t2 (its t1 slot never had a record)
    assert store.create(occurrence("bd-a", t1)).created
    assert store.create(occurrence("bd-b", t2)).created
    # When a brief batch claims those slots, slots past them, and a new entry's
    batch = [
        occurrence("bd-a", t1),
        occurrence("bd-b", t1),
        occurrence("bd-b", t2),
        occurrence("bd-a", t2),
        occurrence("bd-c", t1),
        occurrence("bd-c", t0),
    ]
    results = store.create_many(batch, epoch=store.epoch(), brief=True)
    # Then each answer is create's, in the batch's order, and only the new slots were written
    assert [r.status for r in results] == [
        CreateStatus.EXISTS,
        CreateStatus.BELOW_WATERMARK,
        CreateStatus.EXISTS,
        CreateStatus.CREATED,
        CreateStatus.CREATED,
        CreateStatus.BELOW_WATERMARK,
    ]
    assert {r.epoch for r in results} == {store.epoch()}
    assert store.watermarks(["bd-a", "bd-b", "bd-c"]) == {"bd-a": t2, "bd-b": t2, "bd-c": t1}
    assert store.get(occurrence("bd-b", t1).ref) is None
    assert store.get(occurrence("bd-c", t0).ref) is None
    # And under a stale epoch every claim is refused, decided or not
    stale = store.create_many(batch, epoch="not-the-epoch", brief=True)
    assert {r.status for r in stale} == {CreateStatus.EPOCH_MISMATCH}


def test_watermarks_reads_many_entries_at_once(store: StateStore) -> None:
    t0 = store.now().replace(microsecond=0)
    assert store.create(occurrence("wms-a", t0)).created
    assert store.create(occurrence("wms-b", t0 + timedelta(seconds=1))).created
    marks = store.watermarks(["wms-a", "wms-b", "wms-none", "wms-a"])
    assert marks == {"wms-a": t0, "wms-b": t0 + timedelta(seconds=1)}
    assert store.watermarks([]) == {}


def test_create_many_with_a_stale_epoch_writes_nothing(store: StateStore) -> None:
    epoch = store.epoch()
    t0 = store.now().replace(microsecond=0)
    batch = [occurrence("cm-e", t0), task_job("cm-e-task")]
    results = store.create_many(batch, epoch="not-the-epoch")
    assert {r.status for r in results} == {CreateStatus.EPOCH_MISMATCH}
    assert all(r.epoch == epoch for r in results)
    assert all(store.get(new.ref) is None for new in batch)
    assert store.watermark("cm-e") is None


def test_an_occurrence_id_taken_under_another_entry_exists_and_moves_no_mark(
    store: StateStore,
) -> None:
    if getattr(store, "shards", 1) > 1:
        pytest.skip(
            "a sharded store routes an occurrence by its entry, whose id is the hash of "
            "(namespace, entry, fire time): another entry's create of that id goes to the "
            "other entry's shard (docs/design/redis.md, 'Sharding a namespace over a cluster')"
        )
    # Given an occurrence record made by one entry's claim
    fire = store.now().replace(microsecond=0)
    first = occurrence("entry-one", fire)
    assert store.create(first).created
    # When another entry claims a slot under the same id
    other = NewJob(
        first.ref, "tasks.tick", State.SCHEDULED, node=NODE, entry="entry-two", fire_time=fire
    )
    result = store.create(other)
    # Then the record exists, unchanged, and the other entry's watermark did not move
    assert result.status is CreateStatus.EXISTS
    assert result.job is not None and result.job.rev == first.rev
    assert store.watermark("entry-two") is None
    assert store.watermarks(["entry-one", "entry-two"]) == {"entry-one": fire}
    [batched] = store.create_many([other], brief=True)
    assert batched.status is CreateStatus.EXISTS and store.watermark("entry-two") is None


def test_a_created_record_is_the_one_answered(store: StateStore) -> None:
    epoch = store.epoch()
    for new in (task_job(), task_job(state=State.RUNNING), occurrence("answered", store.now())):
        result = store.create(new, epoch=epoch)
        assert result.created and result.epoch == epoch
        assert result.job == store.get(new.ref)
        assert result.job is not None and result.job.created_at == result.job.touched_at
