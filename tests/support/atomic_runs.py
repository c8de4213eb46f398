"""The atomic gate's checks, one set for every store it runs on (``django://`` and the SQL stores).

A test module builds a :class:`World` (an app on a memory broker and the
store, with ``t.charge``: an atomic task whose body writes one row through
the module's ``write_row``, then does what :attr:`World.action` says) and
calls the checks. Each hands deliveries to the gate in the test's thread (a
second one, for the row lock), as a worker would.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from celery import Celery

from celery_exactonce import ExactOnceTask
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.stores.base import StateStore
from celery_exactonce.task import atomic
from tests.support.deliveries import deliver_to
from tests.support.helpers import poll

#: How long a check waits for a thread to reach a point (polled), at most.
DEADLINE = 20.0

#: How a check sees a statement waiting for a row lock, per database (its dialect's name).
LOCK_WAITS = {
    "postgresql": "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
    "AND datname = current_database()",
    # (MariaDB's innodb_trx leaves out a transaction Django's atomic block began)
    "mysql": "SELECT count(*) FROM information_schema.processlist "
    "WHERE state = 'Updating' AND info LIKE 'UPDATE exactonce_jobs %'",
}


class Died(BaseException):
    """What a worker's death mid-body looks like from inside it (nothing after it runs)."""


@dataclass
class World:
    app: Celery
    store: StateStore
    #: The rows the runs of a task id left (committed).
    rows: Callable[[str], int]
    #: What the body does after writing its row: "return", "raise", "die", "child",
    #: "child then raise", "retry", "wait".
    action: str = "return"
    sent: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    inside: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def job(self, job_id: str) -> Any:
        return self.store.get(JobRef.submitted(job_id))

    def deliver(self, index: int = 0) -> str:
        task_id, headers = self.sent[index]
        return deliver_to(self.app.tasks[headers["task"]], task_id, headers)


def _child(n: int) -> int:
    return n


def register(world: World, write_row: Callable[[Any], None]) -> None:
    """Add ``t.charge`` (atomic: ``write_row(task)``, then :attr:`World.action`) and
    ``t.child`` (gated) to the world's app."""
    app = world.app

    def charge(self: Any, n: int) -> str:
        write_row(self)
        if world.action == "raise":
            raise ValueError("the charge was declined")
        if world.action == "die":
            world.action = "return"  # the next run, after the restart, gets through
            raise Died()
        if world.action in ("child", "child then raise"):
            app.tasks["t.child"].delay(n)
            if world.action == "child then raise":
                raise ValueError("after the child")
        if world.action == "retry" and not self.request.retries:
            raise self.retry(countdown=0, max_retries=3)
        if world.action == "wait":
            world.inside.set()
            assert world.release.wait(DEADLINE)
        return "charged"

    app.task(base=ExactOnceTask, shared=False, bind=True, name="t.charge", exactonce_atomic=True)(
        charge
    )
    app.task(base=ExactOnceTask, shared=False, name="t.child")(_child)


def commits_with_its_end(world: World) -> None:
    world.app.tasks["t.charge"].apply_async((1,), task_id="ok")
    assert world.deliver() == "ran"
    assert world.rows("ok") == 1
    job = world.job("ok")
    assert (job.state, job.reason) == (State.SUCCEEDED, atomic.COMMITTED)
    assert world.deliver() == "ignored"  # a duplicate of it: the job has ended
    assert world.rows("ok") == 1


def rolls_back_and_fails(world: World) -> None:
    world.action = "raise"
    world.app.tasks["t.charge"].apply_async((1,), task_id="no")
    with pytest.raises(ValueError, match="declined"):
        world.deliver()
    assert world.rows("no") == 0
    job = world.job("no")
    assert job.state is State.FAILED
    assert "the charge was declined" in job.reason


def dies_and_runs_once_again(world: World) -> None:
    """SCENARIOS 77: nothing of the dead run committed; the next delivery runs it."""
    world.action = "die"
    world.app.tasks["t.charge"].apply_async((1,), task_id="died")
    with pytest.raises(Died):
        world.deliver()
    assert world.rows("died") == 0
    assert world.job("died").state is State.DISPATCHED  # never seen RUNNING by anyone
    assert world.deliver() == "ran"  # the redelivery (or the reconciler's redispatch)
    assert world.deliver() == "ignored"
    assert world.rows("died") == 1
    assert world.job("died").state is State.SUCCEEDED


def child_iff_committed(world: World, action: str) -> list[str]:
    """SCENARIOS 78: ``action`` "child" commits, "child then raise" rolls back; the
    children's ids (one, or none)."""
    world.action = action
    world.app.tasks["t.charge"].apply_async((7,), task_id="parent")
    if action == "child":
        assert world.deliver() == "ran"
    else:
        with pytest.raises(ValueError, match="after the child"):
            world.deliver()
    children = [i for i, h in world.sent if h["task"] == "t.child"]
    committed = action == "child"
    assert len(children) == (1 if committed else 0)
    if committed:
        assert world.job(children[0]).state is State.DISPATCHED
    assert world.rows("parent") == (1 if committed else 0)
    return children


def duplicate_waits_on_the_row_lock(
    world: World, waiting: Callable[[], bool], *, each_thread: Callable[[], None] = lambda: None
) -> None:
    """SCENARIOS 77: the second delivery's gate waits for the first's transaction (what
    ``waiting`` sees), then finds the job ended. ``each_thread`` ends each delivery's thread."""
    world.action = "wait"
    world.app.tasks["t.charge"].apply_async((1,), task_id="dup")
    verdicts: dict[str, str] = {}

    def deliver(name: str) -> None:
        try:
            verdicts[name] = world.deliver()
        finally:
            each_thread()

    first = threading.Thread(target=deliver, args=("first",))
    first.start()
    assert world.inside.wait(DEADLINE)
    world.action = "return"  # (were the second to run the body, it would not wait)
    second = threading.Thread(target=deliver, args=("second",))
    second.start()
    # The second's gate waits on the first's row lock (or, wrongly, it got through).
    poll(lambda: waiting() or not second.is_alive(), timeout=DEADLINE)
    assert second.is_alive(), verdicts
    world.release.set()
    first.join(DEADLINE)
    second.join(DEADLINE)
    assert verdicts == {"first": "ran", "second": "ignored"}
    assert world.rows("dup") == 1
