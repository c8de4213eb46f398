"""Model-based test: random operations and injected faults, the store against a tiny model.

Hypothesis drives each store and an independent model (a few lines of dict
updates restating docs/design/protocol.md) through random creates, transitions
with right and wrong guards, heartbeats and claims. Any call may fail with an
injected fault, either *before* the request reaches the store or *after* it
applied (a commit whose answer was lost). The test then does what callers
do: it reads the record back and settles the outcome by the op id. After
every step the store and the model must agree on every job.
"""

from __future__ import annotations

import dataclasses
import uuid
from datetime import datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from celery_exactonce.core.exceptions import StoreUnavailable
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import ALLOWED, NEXT_ATTEMPT_EDGES, TERMINAL, State
from celery_exactonce.core.writes import NewJob, Transition
from tests.support.backends import StoreFactory
from tests.support.helpers import NODE

EDGES = sorted(
    ((src, dst) for src, dsts in ALLOWED.items() for dst in dsts), key=lambda e: (e[0], e[1])
)
FAULTS = st.sampled_from(["none", "none", "none", "before", "after"])
GUARD = st.sampled_from(["none", "right", "wrong"])


@dataclasses.dataclass
class Model:
    state: State
    rev: str
    attempt: int = 0
    run_id: str | None = None
    run_at: datetime | None = None


class Fault(StoreUnavailable):
    """An injected fault."""


def call(fault: str, operation: Any) -> Any:
    if fault == "before":
        raise Fault("injected before the request")
    result = operation()
    if fault == "after":
        raise Fault("injected after the request applied")
    return result


class StoreMachine(RuleBasedStateMachine):
    factory: StoreFactory

    def __init__(self) -> None:
        super().__init__()
        # A fresh namespace per example: claims must see only this example's jobs
        self.store = self.factory(f"{self.factory.namespace}-{uuid.uuid4().hex[:8]}")
        prefix = uuid.uuid4().hex[:8]
        self.refs = [JobRef.submitted(f"{prefix}-{i}") for i in range(4)]
        self.model: dict[JobRef, Model] = {}
        self.base = self.store.now() - timedelta(days=1)
        self.ticks = 0

    def _run_at(self) -> datetime:
        self.ticks += 1  # distinct, increasing, all in the past: claim order is predictable
        return self.base + timedelta(seconds=self.ticks)

    @rule(
        i=st.integers(0, 3),
        state=st.sampled_from([State.PENDING, State.SCHEDULED, State.RUNNING]),
        fault=FAULTS,
    )
    def create(self, i: int, state: State, fault: str) -> None:
        ref = self.refs[i]
        new = NewJob(
            ref,
            "tasks.model",
            state,
            node=NODE,
            run_at=self._run_at() if state is State.PENDING else None,
            run_id=uuid.uuid4().hex if state is State.RUNNING else None,
        )
        try:
            result = call(fault, lambda: self.store.create(new))
            assert result.created == (ref not in self.model)
        except Fault:
            pass
        job = self.store.get(ref)
        if ref not in self.model:
            # Settled by reading back: either nothing was written or exactly this create
            if job is not None:
                assert job.rev == new.rev and fault != "before"
                self.model[ref] = Model(state, new.rev, 0, new.run_id, new.run_at)
        else:
            assert job is not None and job.rev == self.model[ref].rev

    @rule(
        i=st.integers(0, 3),
        edge=st.sampled_from(EDGES),
        extra=st.sets(st.sampled_from(list(State))),
        rev=GUARD,
        attempt=GUARD,
        run_id=GUARD,
        task=GUARD,
        fault=FAULTS,
    )
    def transition(
        self,
        i: int,
        edge: tuple[State, State],
        extra: set[State],
        rev: str,
        attempt: str,
        run_id: str,
        task: str,
        fault: str,
    ) -> None:
        src, dst = edge
        ref = self.refs[i]
        nxt = (src, dst) in NEXT_ATTEMPT_EDGES
        # More expected states, where the table allows them for this target
        expect = {src} | {
            s for s in extra if dst in ALLOWED[s] and ((s, dst) in NEXT_ATTEMPT_EDGES) == nxt
        }
        current = self.model.get(ref)

        def guard(kind: str, right: Any, wrong: Any) -> Any:
            return {"none": None, "right": right, "wrong": wrong}[kind]

        request = Transition(
            dst,
            frozenset(expect),
            node=NODE,
            reason="model",
            rev=guard(rev, current.rev if current else "r", "wrong-rev"),
            attempt=guard(attempt, current.attempt if current else 0, 99),
            run_id=guard(run_id, (current.run_id if current else None) or "x", "wrong-run"),
            task=guard(task, "tasks.model", "tasks.other"),
            new_run_id=uuid.uuid4().hex if dst is State.RUNNING else None,
            next_attempt=nxt,
            run_at=self._run_at() if dst is State.PENDING else None,
        )
        expected_applied = (
            current is not None
            and current.state in expect
            and current.state not in TERMINAL
            and request.rev in (None, current.rev)
            and request.attempt in (None, current.attempt)
            and (request.run_id is None or request.run_id == current.run_id)
            and request.task in (None, "tasks.model")
        )
        try:
            result = call(fault, lambda: self.store.transition(ref, request))
            assert result.applied == expected_applied
        except Fault:
            pass
        job = self.store.get(ref)
        applied = job is not None and job.rev == request.new_rev
        assert applied == (expected_applied and fault != "before")
        if applied and current is not None:
            assert job is not None and job.applied(request.new_rev)
            current.state = dst
            current.rev = request.new_rev
            current.attempt += 1 if nxt else 0
            current.run_id = (
                request.new_run_id if dst is State.RUNNING else (None if nxt else current.run_id)
            )
            current.run_at = request.run_at or current.run_at

    @rule(i=st.integers(0, 3), right=st.booleans())
    def heartbeat(self, i: int, right: bool) -> None:
        ref = self.refs[i]
        current = self.model.get(ref)
        run_id = current.run_id if current and right and current.run_id else "nobody"
        touched = self.store.heartbeat(ref, run_id)
        expected = (
            current is not None and current.state is State.RUNNING and current.run_id == run_id
        )
        assert touched == expected

    @rule(limit=st.integers(1, 3), fault=FAULTS)
    def claim(self, limit: int, fault: str) -> None:
        pending = sorted(
            (m.run_at, ref) for ref, m in self.model.items() if m.state is State.PENDING
        )
        due = [ref for _, ref in pending][:limit]
        try:
            claimed = call(fault, lambda: self.store.claim_due(limit, node=NODE))
            assert [job.ref for job in claimed] == due
        except Fault:
            pass
        for ref in due:
            job = self.store.get(ref)
            assert job is not None
            if fault == "before":
                assert job.state is State.PENDING
            else:
                assert job.state is State.SCHEDULED
                self.model[ref].state, self.model[ref].rev = State.SCHEDULED, job.rev

    @invariant()
    def store_agrees_with_model(self) -> None:
        for ref in self.refs:
            job = self.store.get(ref)
            model = self.model.get(ref)
            if model is None:
                assert job is None
                continue
            assert job is not None
            assert (job.state, job.rev, job.attempt, job.run_id) == (
                model.state,
                model.rev,
                model.attempt,
                model.run_id,
            )
            if model.state is State.PENDING:
                assert job.run_at == model.run_at


@pytest.mark.parametrize("steps", [40])
def test_store_agrees_with_the_model(store_factory: StoreFactory, steps: int) -> None:
    examples = 60 if store_factory.backend == "memory" else 25
    machine = type("Machine", (StoreMachine,), {"factory": store_factory})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
            database=None,
        ),
    )
