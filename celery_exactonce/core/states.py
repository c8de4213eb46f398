"""Job states and their transition table (docs/design/protocol.md, "States and transitions").

The table is data, not code: every store checks a requested transition
against it before touching a record, so no backend can drift from another.
"""

from __future__ import annotations

import enum


class State(str, enum.Enum):
    """Where a job is in its life. The five last ones are terminal."""

    PENDING = "PENDING"
    """Waiting for its ``run_at`` (a delayed job)."""
    SCHEDULED = "SCHEDULED"
    """Claimed by a dispatcher, about to be published."""
    DISPATCHED = "DISPATCHED"
    """Written before the publish; a message may be on the broker."""
    RUNNING = "RUNNING"
    """A worker passed the gate; the body runs (or ran) under ``run_id``."""
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMEOUT = "TIMEOUT"
    PUBLISHED = "PUBLISHED"
    """Terminal for a plain (ungated) job once its publish returned."""

    @property
    def terminal(self) -> bool:
        """Whether no transition may leave this state."""
        return self in TERMINAL

    def __str__(self) -> str:
        return self.value


TERMINAL = frozenset(
    {State.SUCCEEDED, State.FAILED, State.CANCELLED, State.TIMEOUT, State.PUBLISHED}
)
LIVE = frozenset(State) - TERMINAL

#: States a job may be created in (∅ → state).
CREATABLE = frozenset({State.PENDING, State.SCHEDULED, State.RUNNING})

#: Allowed ``from → to`` edges (docs/design/protocol.md). Terminal states have none.
ALLOWED: dict[State, frozenset[State]] = {
    State.PENDING: frozenset({State.SCHEDULED, State.CANCELLED}),
    State.SCHEDULED: frozenset(
        {State.DISPATCHED, State.PENDING, State.RUNNING, State.FAILED, State.CANCELLED}
    ),
    State.DISPATCHED: frozenset(
        {
            State.SCHEDULED,
            State.DISPATCHED,
            State.RUNNING,
            State.PUBLISHED,
            State.TIMEOUT,
            State.CANCELLED,
            # A record refused before its (re)publish: its signature does not verify.
            State.FAILED,
        }
    ),
    State.RUNNING: frozenset(
        {
            State.SUCCEEDED,
            State.FAILED,
            State.CANCELLED,
            State.TIMEOUT,
            # The gate's take-over: a delivery sent back by a gate that could not
            # learn whether its write applied claims that run under a fresh run_id.
            State.RUNNING,
            # A Celery retry (or an opted-in re-run): the next attempt only.
            State.DISPATCHED,
            State.PENDING,
        }
    ),
    **{state: frozenset() for state in TERMINAL},
}

#: Edges that start a new attempt: allowed only with ``next_attempt=True``,
#: and ``next_attempt`` is allowed only on them.
NEXT_ATTEMPT_EDGES = frozenset({(State.RUNNING, State.DISPATCHED), (State.RUNNING, State.PENDING)})
