"""What the model covers: its transitions against ``core/states.py``, and its variants.

What it holds: the edges the model performs, the edges it leaves out (each
with the reason), the comparison of both with the table the stores enforce
(``CREATABLE``, ``ALLOWED``, ``NEXT_ATTEMPT_EDGES``, read when it runs, so
an edge added to ``states.py`` fails the comparison until the model knows
it), and the named variants: the design, and the design with one rule
dropped, each with the property its shortest counterexample breaks.
"""

from __future__ import annotations

import dataclasses

from celery_exactonce.core import states
from celery_exactonce.core.states import State

from .checker import Bounds, Model, Result, Rules, search

Edge = tuple[State | None, State]  # ``None``: the record is created

P, S, D, R = State.PENDING, State.SCHEDULED, State.DISPATCHED, State.RUNNING
F, C, T, OK, PUB = State.FAILED, State.CANCELLED, State.TIMEOUT, State.SUCCEEDED, State.PUBLISHED

#: Edges the model's actors take (each one is reached by the design's search).
MODELLED: frozenset[Edge] = frozenset(
    {
        (None, S),  # a beat claim
        (S, D),  # a beat node's dispatch, a reconciler replay
        (D, S),  # the rollback after a definite publish failure
        (S, R),  # the gate, for a message whose "definite" failure landed after all
        (D, R),  # the gate
        (R, R),  # the gate's take-over of a run by the ticket of a send-back copy
        (R, OK),  # the worker's outcome
        (R, D),  # a Celery retry: the next attempt
        (D, T),  # the reconciler
        (R, T),  # the reconciler
    }
)

#: Edges the model leaves out, and why.
OUT_OF_SCOPE: dict[Edge, str] = {
    (None, P): "delayed jobs: the sweep's claim is a CAS like the beat claim",
    (None, R): "adoption of a message without our headers",
    (P, S): "delayed jobs",
    (P, C): "cancel()",
    (S, P): "nobody takes it today",
    (S, F): "unbuildable messages, bad signatures, replays exhausted",
    (S, C): "cancel(), revoke, deadlines",
    (D, D): "opt-in redispatch",
    (D, PUB): "plain (ungated) jobs",
    (D, F): "bad signatures",
    (D, C): "deadlines, revoke",
    (R, F): "written like SUCCEEDED, on the run_id",
    (R, C): "written like SUCCEEDED, on the run_id",
    (R, P): "a retry with a countdown: like RUNNING -> DISPATCHED",
}

#: The model's next-attempt edge: its Celery retry.
NEXT_ATTEMPT: frozenset[tuple[State, State]] = frozenset({(R, D)})


def table_edges() -> set[Edge]:
    """Every edge ``celery_exactonce.core.states`` allows now, creation included."""
    edges: set[Edge] = {(None, state) for state in states.CREATABLE}
    edges |= {(a, b) for a, targets in states.ALLOWED.items() for b in targets}
    return edges


def _name(edge: Edge) -> str:
    return f"{edge[0].value if edge[0] else '(none)'} -> {edge[1].value}"


def differences() -> list[str]:
    """How the model's edges and ``states.py``'s table disagree (empty: they agree)."""
    table, known = table_edges(), MODELLED | set(OUT_OF_SCOPE)
    found = [
        f"states.py allows {_name(e)}, which the model neither performs nor leaves out by name"
        for e in sorted(table - known, key=_name)
    ]
    found += [
        f"the model knows {_name(e)}, which states.py does not allow"
        for e in sorted(known - table, key=_name)
    ]
    found += [
        f"{_name(e)} is both modelled and out of scope"
        for e in sorted(MODELLED & set(OUT_OF_SCOPE), key=_name)
    ]
    for edge in sorted(states.NEXT_ATTEMPT_EDGES - NEXT_ATTEMPT, key=_name):
        if edge in MODELLED:
            found.append(f"states.py makes {_name(edge)} a next attempt; the model does not")
    found += [
        f"the model's next attempt {_name(e)} is not one in states.py"
        for e in sorted(NEXT_ATTEMPT - states.NEXT_ATTEMPT_EDGES, key=_name)
    ]
    return found


@dataclasses.dataclass(frozen=True)
class Variant:
    """A named set of rules, and what its search must find."""

    rules: Rules
    breaks: str | None  # the property its shortest counterexample breaks; None: passes
    summary: str


VARIANTS: dict[str, Variant] = {
    "baseline": Variant(Rules(), None, "the design: every rule on"),
    "gate_checks_attempt": Variant(
        Rules(gate_checks_attempt=False),
        "S1",
        "a retry moves the job to attempt 1; the attempt-0 message comes back "
        "(a crash) and passes the gate: attempt 0 runs twice",
    ),
    "send_back_tickets_need_takeover": Variant(
        Rules(send_back_tickets_need_takeover=False),
        "S1",
        "a gate write applies but cannot be read back; the send-back copy is "
        "duplicated, and each copy owning the ticket outright runs the body",
    ),
    "dispatched_written_before_publish": Variant(
        Rules(dispatched_written_before_publish=False),
        "S3",
        "a beat node publishes while the record still says SCHEDULED, which the "
        "reconciler replays as never published",
    ),
    "reconciler_uses_rev_cas": Variant(
        Rules(reconciler_uses_rev_cas=False),
        "S3",
        "the reconciler lists SCHEDULED at attempt 0; a retry's rollback leaves "
        "SCHEDULED at attempt 1; a state-only CAS lets the replay publish attempt 0",
    ),
}


def run(name: str, bounds: Bounds | None = None) -> Result:
    """Search the named variant."""
    return search(Model(VARIANTS[name].rules, bounds))
