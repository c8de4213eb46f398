"""The transactional submit: inside ``transaction.atomic()`` on the django:// store.

The job is written in the caller's transaction and published once it commits:
a rollback leaves no job and no message. (The crash between the commit and the
publish is a real process SIGKILLed: tests/acceptance/test_django_submit.py.)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from celery import Celery

from celery_exactonce import ExactOnceTask, runtime
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.stores.base import StateStore
from tests.django_tests import routing
from tests.support.publishing import publishing


@dataclass
class World:
    app: Celery
    store: StateStore
    sent: list[str] = field(default_factory=list)

    def job_state(self, task_id: str) -> State | None:
        job = self.store.get(JobRef.submitted(task_id))
        return None if job is None else job.state


@pytest.fixture
def world(alias: str) -> Iterator[World]:
    app = Celery("tx-submit", broker="memory://", set_as_current=False)
    app.conf.update(exactonce_store_url=f"django://{alias}", exactonce_namespace="tx-submit")
    app.task(base=ExactOnceTask, shared=False, name="t.welcome")(welcome)
    rt = runtime.runtime_for(app)
    rt.store.setup()
    world = World(app, rt.store)

    def capture(sender: Any = None, headers: Any = None, **_kw: Any) -> None:
        world.sent.append(headers["id"])

    with publishing(app, capture):
        yield world


def welcome(user: int) -> None:
    """The task's body (never run here: the tests watch what is published)."""


def _user(name: str) -> Any:
    from django.contrib.auth.models import User

    return User.objects.create(username=name)


def test_a_committed_transaction_publishes_its_job_once_after_the_commit(
    alias: str, world: World
) -> None:
    from django.db import transaction

    with transaction.atomic(using=alias):
        user = _user("ada")
        result = world.app.tasks["t.welcome"].apply_async((user.pk,), task_id="welcome-ada")
        assert world.sent == []  # not before the commit
        assert world.job_state("welcome-ada") is State.SCHEDULED  # the caller sees its job
    assert result.id == "welcome-ada"
    assert world.sent == ["welcome-ada"]
    assert world.job_state("welcome-ada") is State.DISPATCHED  # a gated job: the gate runs it


def test_a_rolled_back_transaction_leaves_no_job_and_no_message(alias: str, world: World) -> None:
    from django.contrib.auth.models import User
    from django.db import transaction

    class Abort(Exception):
        pass

    with pytest.raises(Abort), transaction.atomic(using=alias):
        user = _user("bob")
        world.app.tasks["t.welcome"].apply_async((user.pk,), task_id="welcome-bob")
        raise Abort
    assert not User.objects.filter(username="bob").exists()
    assert world.job_state("welcome-bob") is None
    assert world.sent == []


def test_a_rolled_back_savepoint_drops_only_its_own_job(alias: str, world: World) -> None:
    from django.db import transaction

    with transaction.atomic(using=alias):
        world.app.tasks["t.welcome"].apply_async((1,), task_id="kept")
        try:
            with transaction.atomic(using=alias):
                world.app.tasks["t.welcome"].apply_async((2,), task_id="dropped")
                raise RuntimeError("inner block fails")
        except RuntimeError:
            pass
    assert world.sent == ["kept"]
    assert world.job_state("dropped") is None


def test_outside_a_transaction_the_submit_publishes_at_once(alias: str, world: World) -> None:
    world.app.tasks["t.welcome"].apply_async((1,), task_id="at-once")
    assert world.sent == ["at-once"]
    assert world.job_state("at-once") is State.DISPATCHED


@pytest.fixture
def mysql_world() -> Iterator[World]:
    """:func:`world` on the ``mysql`` database (``REPEATABLE READ``), every model routed there."""
    routing.ALIAS = "mysql"
    try:
        yield from world.__wrapped__("mysql")  # type: ignore[attr-defined]
    finally:
        routing.ALIAS = "default"


@pytest.mark.mysql
@pytest.mark.django_db(databases=["mysql"], transaction=True)
def test_a_submit_inside_a_repeatable_read_transaction_finds_a_job_committed_since(
    mysql_world: World,
) -> None:
    """MySQL at ``REPEATABLE READ``: the job another connection committed after this
    transaction's first read is the same job, not ``SubmitAmbiguous``.

    Before the fix, the create's insert met the other job's key, and its read of
    that record saw the transaction's old snapshot, where the record is absent:
    the submit raised ``SubmitAmbiguous`` for a job that exists.
    """
    from django.contrib.auth.models import User
    from django.db import connections, transaction

    task = mysql_world.app.tasks["t.welcome"]

    def elsewhere() -> None:  # another connection (Django's are per thread), committed at once
        try:
            task.apply_async((7,), task_id="made-elsewhere")
        finally:
            connections["mysql"].close()

    with transaction.atomic(using="mysql"):
        assert not User.objects.exists()  # this transaction's snapshot is taken here
        other = threading.Thread(target=elsewhere)
        other.start()
        other.join(timeout=30)
        assert mysql_world.sent == ["made-elsewhere"]
        result = task.apply_async((7,), task_id="made-elsewhere")  # the same job again
        assert result.id == "made-elsewhere"
    # Found DISPATCHED with no proof its message left, it is published again once the
    # transaction committed (the gate drops a copy), not refused
    assert mysql_world.sent == ["made-elsewhere", "made-elsewhere"]
    assert mysql_world.job_state("made-elsewhere") is State.DISPATCHED
