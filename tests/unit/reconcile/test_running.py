"""RUNNING jobs whose worker vanished: the heartbeat timeout and the opted-in re-run.

A job times out ``running_timeout`` after its last heartbeat (a late outcome
of the vanished run changes nothing), a task that opts in to re-run gets its
next attempt published once, and a timeout is reported to Sentry with its job.
"""

from __future__ import annotations

from typing import Any

import pytest

from celery_exactonce.core.states import State
from celery_exactonce.core.writes import Transition
from celery_exactonce.observe import metrics
from tests.support.reconciler_world import MICROSECOND, RUNNING_TIMEOUT, World
from tests.support.reconciling import RERUN, gate


def test_running_without_heartbeat_for_running_timeout_times_out(world: World) -> None:
    # Given a running job that heartbeats, then stops (its worker died)
    job = world.put(State.RUNNING)
    world.advance(500)
    assert world.store.heartbeat(job.ref, job.run_id or "")
    world.advance(RUNNING_TIMEOUT - MICROSECOND)
    world.run()
    # Then it is RUNNING until running_timeout after its last heartbeat
    assert world.state(job) is State.RUNNING
    world.advance(MICROSECOND)
    report = world.run()
    after = world.get(job)
    assert after.state is State.TIMEOUT and after.reason == "no heartbeat for 600 s"
    assert report.timed_out == 1 and world.broker.tries == 0
    # A late outcome of the vanished run changes nothing
    done = Transition(
        State.SUCCEEDED, frozenset({State.RUNNING}), node="w", reason="late", run_id=job.run_id
    )
    assert not world.store.transition(job.ref, done).applied


def test_opted_in_rerun_publishes_the_next_attempt_once(world: World) -> None:
    # Given a running job of a task that opts in to re-run, its worker gone
    job = world.put(State.RUNNING, RERUN)
    world.advance(RUNNING_TIMEOUT)
    # When passes run (short of the next attempt's own timeouts)
    report = world.run()
    for _ in range(10):
        world.advance(60)
        world.run()
    # Then the next attempt is DISPATCHED and published once
    after = world.get(job)
    assert (after.state, after.attempt, after.run_id) == (State.DISPATCHED, 1, None)
    assert report.rerun == 1 and world.broker.sent == [(job.ref.id, 1)]
    # and only a delivery of that attempt passes the gate
    assert world.get(job).attempt == 1
    run = gate(world.store, after)
    assert run.state is State.RUNNING and run.attempt == 1


def test_a_timeout_is_reported_to_sentry_with_its_job(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    reports: list[tuple[str, dict[str, Any]]] = []

    def capture(action: str, message: str, tags: Any, exc: Any = None, **_kw: Any) -> bool:
        reports.append((action, dict(tags)))
        return True

    monkeypatch.setattr(metrics, "report_to_sentry", capture)
    # Given a running job whose worker vanished, and a live one
    dead, live = world.put(State.RUNNING), world.put(State.RUNNING)
    world.advance(RUNNING_TIMEOUT)
    assert world.store.heartbeat(live.ref, live.run_id or "")
    # When a pass times the dead one out
    assert world.run().timed_out == 1
    # Then one Sentry event names the action, the state and the job; none for the live one
    assert [(action, tags.get("job_id"), tags.get("state")) for action, tags in reports] == [
        ("timed_out", dead.ref.id, "RUNNING")
    ]
