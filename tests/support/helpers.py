"""Builders and polling helpers shared by the contract tests."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, TypeVar

from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition
from celery_exactonce.dispatch.messages import GATED_OPTION
from celery_exactonce.stores import InMemoryStore
from celery_exactonce.stores.base import StateStore

T = TypeVar("T")

NODE = "node-a"


def task_job(
    job_id: str | None = None,
    state: State = State.SCHEDULED,
    *,
    run_at: datetime | None = None,
    task: str = "tasks.add",
    args: tuple[object, ...] = (1, 2),
    kwargs: dict[str, object] | None = None,
) -> NewJob:
    """A caller-chosen job (``apply_async``), SCHEDULED unless told otherwise."""
    run_id = uuid.uuid4().hex if state is State.RUNNING else None
    return NewJob(
        ref=JobRef.submitted(job_id or uuid.uuid4().hex),
        task=task,
        state=state,
        node=NODE,
        args=args,
        kwargs=kwargs if kwargs is not None else {"x": "ü"},
        options={"queue": "celery"},
        run_at=run_at,
        run_id=run_id,
    )


def occurrence(entry: str, fire_time: datetime, task: str = "tasks.tick") -> NewJob:
    """A beat occurrence of ``entry`` at ``fire_time`` (its id derived from both)."""
    return NewJob(
        ref=JobRef.occurrence(f"{entry}@{fire_time.isoformat()}"),
        task=task,
        state=State.SCHEDULED,
        node=NODE,
        entry=entry,
        fire_time=fire_time,
    )


def submitted(job_id: str = "w1", *, gated: bool = True) -> NewJob:
    """A ``SCHEDULED`` job as a submit makes it, gated (``ExactOnceTask``) unless told not."""
    options = {GATED_OPTION: gated, "queue": "q"}
    return NewJob(
        JobRef.submitted(job_id), "tasks.t", State.SCHEDULED, node="n", args=[1], options=options
    )


def to(state: State, *expect: State, **guards: object) -> Transition:
    """A transition request to ``state`` from any of ``expect``."""
    return Transition(state, frozenset(expect), node=NODE, reason="test", **guards)  # type: ignore[arg-type]


def move(store: StateStore, job: Job, to: State) -> Job:
    """CAS ``job`` to ``to`` (on its rev; into RUNNING as the gate does, out of it on the run)."""
    guards: dict[str, Any] = {"rev": job.rev}
    if to is State.RUNNING:
        guards = {"new_run_id": uuid.uuid4().hex, "attempt": job.attempt}
    elif job.state is State.RUNNING:
        guards = {"run_id": job.run_id}
    request = Transition(to, frozenset({job.state}), node="n", reason="test", **guards)
    result = store.transition(job.ref, request)
    assert result.applied and result.job is not None, (job.ref, to, result.status)
    return result.job


#: How each state is reached from the one a job is created in.
PATHS = {
    State.PENDING: [],
    State.SCHEDULED: [],
    State.DISPATCHED: [State.DISPATCHED],
    State.PUBLISHED: [State.DISPATCHED, State.PUBLISHED],
    State.RUNNING: [State.DISPATCHED, State.RUNNING],
    State.SUCCEEDED: [State.DISPATCHED, State.RUNNING, State.SUCCEEDED],
    State.FAILED: [State.DISPATCHED, State.RUNNING, State.FAILED],
    State.CANCELLED: [State.CANCELLED],
    State.TIMEOUT: [State.DISPATCHED, State.TIMEOUT],
}


def jobs_in_every_state(
    store: StateStore, prefix: str = "job", task_prefix: str = "tasks"
) -> dict[State, Job]:
    """A submitted job of its own in each state, ``<prefix>-<state>`` (lower case), of the
    task ``<task_prefix>.<state>``, each touched after the one before; the ``PENDING`` one
    due in an hour."""
    later = store.now() + timedelta(hours=1)
    made = {}
    for state, path in PATHS.items():
        delayed = state is State.PENDING
        new = task_job(
            f"{prefix}-{state.value.lower()}",
            State.PENDING if delayed else State.SCHEDULED,
            run_at=later if delayed else None,
            task=f"{task_prefix}.{state.value.lower()}",
        )
        result = store.create(new)
        assert result.created and result.job is not None
        job = result.job
        for step in path:
            job = move(store, job, step)
        made[state] = job
        wait_store_past(store, job.touched_at)  # distinct touch times: one order
    return made


def poll(check: Callable[[], T | None], timeout: float = 10.0, interval: float = 0.02) -> T:
    """Call ``check`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


def wait_store_past(store: StateStore, instant: datetime) -> None:
    """Poll until the store's clock is strictly past ``instant``."""
    poll(lambda: store.now() > instant)


def tamper(store: StateStore, ref: JobRef, field: str, value: Any) -> None:
    """Change one field of a stored record behind the store's back, in the backend itself.

    ``field`` is ``args``, ``kwargs``, ``options``, ``task`` or ``signature``
    (``value`` ``None`` removes the signature).
    """
    if isinstance(store, InMemoryStore):
        job = store._jobs[ref]
        store._jobs[ref] = dataclasses.replace(job, **{field: value})
    elif hasattr(store, "_client") or hasattr(store, "_parts"):  # Redis: the record is a hash
        if hasattr(store, "_parts"):  # a sharded Redis store: the record is on one shard
            store = store._parts[store._locate(ref)[0]]
        client, key = store._client, store._job_key(ref)  # type: ignore[attr-defined]
        if value is None:
            client.hdel(key, field)
        else:
            client.hset(key, field, value if field in ("task", "signature") else json.dumps(value))
    else:  # SQL: one row; args, kwargs, options and the signature in the payload document
        import sqlalchemy as sa

        table = store._t.jobs  # type: ignore[attr-defined]
        where = (
            (table.c.namespace == store.namespace)
            & (table.c.space == ref.space.value)
            & (table.c.id == ref.id)
        )
        with store.engine.begin() as conn:  # type: ignore[attr-defined]
            if field == "task":
                conn.execute(sa.update(table).where(where).values(task=value))
                return
            payload = json.loads(conn.execute(sa.select(table.c.payload).where(where)).scalar_one())
            if value is None:
                payload.pop(field, None)
            else:
                payload[field] = value
            conn.execute(sa.update(table).where(where).values(payload=json.dumps(payload)))


@contextmanager
def pooled_driver(store: Any) -> Iterator[Any]:
    """The DB-API connection of a SQL store's pool (one thread: one), in autocommit while held."""
    raw = store.engine.raw_connection()
    driver: Any = raw.driver_connection
    driver.autocommit = True
    try:
        yield driver
    finally:
        driver.autocommit = False
        raw.close()
