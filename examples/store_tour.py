"""A tour of the job store: what beat, the sweeper and the worker gate do underneath.

Run it with no servers (SQLite in a temporary file):

    python examples/store_tour.py

or against a real store:

    python examples/store_tour.py redis://127.0.0.1:6379/0

It claims one beat slot twice (the second claim loses), moves the job through
the worker gate (a redelivery is refused), and sweeps a delayed job.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import uuid
from datetime import timedelta

from celery_exactonce import idempotency_key, store_from_url
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import NewJob, Transition


def main(url: str) -> int:
    namespace = f"tour-{uuid.uuid4().hex[:8]}"  # a fresh namespace: the tour can run again
    store = store_from_url(url, namespace=namespace, retention=3600)
    store.setup()
    try:
        epoch = store.epoch()
        fire_time = store.now().replace(microsecond=0)
        key = idempotency_key("nightly-report", fire_time, namespace=namespace)
        slot = NewJob(
            ref=JobRef.occurrence(key),
            task="reports.nightly",
            state=State.SCHEDULED,
            node="beat-1",
            entry="nightly-report",
            fire_time=fire_time,
        )
        # Two beat nodes claim the same slot: one creates it, the other sees it exists.
        first = store.create(slot, epoch=epoch)
        second = store.create(dataclasses.replace(slot, node="beat-2"), epoch=epoch)
        print(f"beat-1 claim: {first.status.value}; beat-2 claim: {second.status.value}")

        # The dispatcher writes DISPATCHED before it publishes.
        dispatched = store.transition(
            slot.ref,
            Transition(
                State.DISPATCHED,
                frozenset({State.SCHEDULED}),
                node="beat-1",
                reason="publish",
                rev=slot.rev,
            ),
        )
        print(f"dispatch CAS: {dispatched.status.value}")

        # The worker gate: one delivery per attempt passes, a redelivery is refused.
        def gate(run_id: str) -> str:
            request = Transition(
                State.RUNNING,
                frozenset({State.SCHEDULED, State.DISPATCHED}),
                node="worker",
                reason="gate",
                attempt=0,
                new_run_id=run_id,
            )
            return store.transition(slot.ref, request).status.value

        print(f"first delivery: {gate('run-1')}; redelivery: {gate('run-2')}")
        done = store.transition(
            slot.ref,
            Transition(
                State.SUCCEEDED,
                frozenset({State.RUNNING}),
                node="worker",
                reason="body returned",
                run_id="run-1",
            ),
        )
        assert done.job is not None
        print(
            f"final state: {done.job.state.value}, history: "
            + " -> ".join(h.dst.value for h in done.job.history)
        )

        # A delayed job lives in the store until it is due, then one sweeper claims it.
        delayed = NewJob(
            JobRef.submitted("send-reminder-42"),
            "mail.remind",
            State.PENDING,
            node="api",
            kwargs={"user": 42},
            run_at=store.now() - timedelta(seconds=1),
        )
        store.create(delayed)
        claimed = store.claim_due(10, node="beat-1")
        print(
            f"swept: {[job.ref.id for job in claimed]}; again: {store.claim_due(10, node='beat-2')}"
        )
        print(f"idempotency key of the slot: {key}")
        return 0 if first.created and not second.created else 1
    finally:
        drop = getattr(store, "drop_namespace", None)
        if drop is not None:
            drop()
        store.close()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.exit(main(sys.argv[1]))
    with tempfile.TemporaryDirectory() as tmp:
        sys.exit(main(f"sqlite:///{os.path.join(tmp, 'tour.db')}"))
