"""What the model covers: its transitions against ``core/states.py``, and its variants.

What it holds: the edges the model performs, the edges it leaves out (each
with the reason), the comparison of both with the table the stores enforce
(``CREATABLE``, ``ALLOWED``, ``NEXT_ATTEMPT_EDGES``, read when it runs, so
an edge added to ``core/states.py`` fails the comparison until the model knows
it), and the named variants: the design, and the design with one rule
dropped, each with the property its shortest counterexample breaks.
"""

from __future__ import annotations

import dataclasses

from ._table import State, states
from .checker import search
from .model import Model
from .world import Bounds, Result, Rules, Scenario

Edge = tuple[State | None, State]  # ``None``: the record is created

P, S, D, R = State.PENDING, State.SCHEDULED, State.DISPATCHED, State.RUNNING
F, C, T, OK, PUB = State.FAILED, State.CANCELLED, State.TIMEOUT, State.SUCCEEDED, State.PUBLISHED

#: Edges the model's actors take (each one is reached by a baseline's search).
MODELLED: frozenset[Edge] = frozenset(
    {
        (None, S),  # a beat claim; the one-step submit (its history: create, then dispatch)
        (None, P),  # a delayed submit
        (None, R),  # the gate's adoption of a message without our headers
        (P, S),  # the sweep's claim
        (P, C),  # cancel()
        (S, D),  # a dispatch: beat node, sweeper, resubmission, reconciler replay; one-step
        (S, R),  # the gate, for a message whose "definite" failure landed after all
        (S, F),  # the reconciler, replays exhausted
        (S, C),  # cancel(); the reconciler past the deadline
        (D, S),  # the rollback after a definite publish failure
        (D, D),  # the reconciler's opted-in redispatch
        (D, R),  # the gate
        (D, C),  # a dispatcher that finds the deadline passed before its publish
        (D, T),  # the reconciler
        (R, R),  # the gate's take-over of a run by the ticket of a send-back copy
        (R, OK),  # the worker's outcomes, on the run_id
        (R, F),
        (R, C),
        (R, T),  # the reconciler
        (R, D),  # a Celery retry; the reconciler's opted-in re-run: the next attempt
        (R, P),  # a Celery retry with a countdown: the next attempt, delayed
    }
)

#: Edges the model leaves out, and why.
OUT_OF_SCOPE: dict[Edge, str] = {
    (S, P): "nobody takes it today",
    (D, PUB): "plain (ungated) jobs",
    (D, F): "bad signatures",
}

#: The model's next-attempt edges: its Celery retries and the reconciler's re-run.
NEXT_ATTEMPT: frozenset[tuple[State, State]] = frozenset({(R, D), (R, P)})


def table_edges() -> set[Edge]:
    """Every edge ``celery_exactonce.core.states`` allows now, creation included."""
    edges: set[Edge] = {(None, state) for state in states.CREATABLE}
    edges |= {(a, b) for a, targets in states.ALLOWED.items() for b in targets}
    return edges


def _name(edge: Edge) -> str:
    return f"{edge[0].value if edge[0] else '(none)'} -> {edge[1].value}"


def differences() -> list[str]:
    """How the model's edges and ``core/states.py``'s table disagree (empty: they agree)."""
    table, known = table_edges(), MODELLED | set(OUT_OF_SCOPE)
    found = [
        f"core/states.py allows {_name(e)}, which the model neither performs nor leaves out by name"
        for e in sorted(table - known, key=_name)
    ]
    found += [
        f"the model knows {_name(e)}, which core/states.py does not allow"
        for e in sorted(known - table, key=_name)
    ]
    found += [
        f"{_name(e)} is both modelled and out of scope"
        for e in sorted(MODELLED & set(OUT_OF_SCOPE), key=_name)
    ]
    for edge in sorted(states.NEXT_ATTEMPT_EDGES - NEXT_ATTEMPT, key=_name):
        if edge in MODELLED:
            found.append(f"core/states.py makes {_name(edge)} a next attempt; the model does not")
    found += [
        f"the model's next attempt {_name(e)} is not one in core/states.py"
        for e in sorted(NEXT_ATTEMPT - states.NEXT_ATTEMPT_EDGES, key=_name)
    ]
    return found


@dataclasses.dataclass(frozen=True)
class Variant:
    """A named set of rules in a scenario, what its search must find, and how far it goes."""

    rules: Rules
    scenario: Scenario
    breaks: str | None  # the property its shortest counterexample breaks; None: passes
    summary: str
    bounds: Bounds  # the default run's (seconds)
    full: tuple[Bounds, ...]  # the full matrix's (``python -m tests.model --full``)


@dataclasses.dataclass(frozen=True)
class Setting:
    """A scenario with its bounds: small for the default run, wider for the full matrix."""

    scenario: Scenario
    bounds: Bounds
    full: tuple[Bounds, ...]


BEAT = Setting(Scenario(), Bounds(), (Bounds(faults=3, passes=2), Bounds(passes=2, reconcilers=2)))
STORE_LOSS = Setting(Scenario(losses=1), Bounds(faults=1), (Bounds(passes=2),))
DELAYED = Setting(Scenario(start="delayed"), Bounds(faults=1), (Bounds(passes=2),))
ENQUEUE = Setting(
    Scenario(start="enqueue", outcomes=(OK, F, C), liveness=True),
    Bounds(),
    (Bounds(faults=3, passes=2, reconcilers=2),),
)
ENQUEUE_SQL = Setting(
    dataclasses.replace(ENQUEUE.scenario, one_write=False),
    Bounds(faults=3),
    (Bounds(faults=4, passes=2, reconcilers=2),),
)
#: The same submit with every fault (crashes, publish failures): safety only.
ENQUEUE_SQL_FAULTS = Setting(
    dataclasses.replace(ENQUEUE_SQL.scenario, liveness=False),
    Bounds(),
    (Bounds(faults=3, passes=2, reconcilers=2),),
)
FOREIGN = Setting(
    Scenario(start="foreign", outcomes=(OK, F, C)),
    Bounds(),
    (Bounds(faults=3, passes=2, reconcilers=2),),
)
RERUN = Setting(
    Scenario(rerun=True),
    Bounds(faults=0, passes=2, reconcilers=2),
    (Bounds(passes=2), Bounds(faults=1, passes=2, reconcilers=2)),
)

#: An atomic job on a SQL store (the record written, then published): safety with
#: every fault, the effects checked (E1-E3) in place of S1.
ATOMIC = Setting(
    Scenario(start="enqueue", outcomes=(OK, F), one_write=False, atomic=True),
    Bounds(retries=0),
    (Bounds(faults=3, passes=2, reconcilers=2, retries=0),),
)


def _variant(setting: Setting, breaks: str | None, summary: str, drop: str = "") -> Variant:
    rules = dataclasses.replace(Rules(), **{drop: False}) if drop else Rules()
    return Variant(rules, setting.scenario, breaks, summary, setting.bounds, setting.full)


VARIANTS: dict[str, Variant] = {
    "baseline": _variant(BEAT, None, "the design: beat nodes claim one occurrence"),
    "storeloss": _variant(STORE_LOSS, None, "the design, and the store loses its data once"),
    "delayed": _variant(DELAYED, None, "a delayed job: the sweep, cancel(), deadlines"),
    "enqueue": _variant(ENQUEUE, None, "the one-step submit, with L checked"),
    "enqueue_sql": _variant(
        ENQUEUE_SQL, None, "the submit that writes the record, then publishes, with L checked"
    ),
    "enqueue_sql_faults": _variant(
        ENQUEUE_SQL_FAULTS, None, "the same, with crashes and publish failures: S1-S4"
    ),
    "foreign": _variant(FOREIGN, None, "a message without our headers, adopted at the gate"),
    "rerun": _variant(RERUN, None, "the reconciler's redispatch and re-run opted in"),
    "gate_checks_attempt": _variant(
        BEAT,
        "S1",
        "a retry moves the job to attempt 1; the attempt-0 message comes back "
        "(a crash) and passes the gate: attempt 0 runs twice",
        "gate_checks_attempt",
    ),
    "send_back_tickets_need_takeover": _variant(
        BEAT,
        "S1",
        "a gate write applies but cannot be read back; the send-back copy is "
        "duplicated, and each copy owning the ticket outright runs the body",
        "send_back_tickets_need_takeover",
    ),
    "dispatched_written_before_publish": _variant(
        BEAT,
        "S3",
        "a beat node publishes while the record still says SCHEDULED, which the "
        "reconciler replays as never published",
        "dispatched_written_before_publish",
    ),
    "reconciler_uses_rev_cas": _variant(
        BEAT,
        "S3",
        "the reconciler lists SCHEDULED at attempt 0; a retry's rollback leaves "
        "SCHEDULED at attempt 1; a state-only CAS lets the replay publish attempt 0",
        "reconciler_uses_rev_cas",
    ),
    "claims_carry_epoch": _variant(
        STORE_LOSS,
        "S2",
        "the job ends; the store loses its data; a node still holding the old "
        "epoch claims the slot again",
        "claims_carry_epoch",
    ),
    "claims_respect_floor": _variant(
        STORE_LOSS,
        "S2",
        "the job ends; the store loses its data; a node restarts, reads the new "
        "epoch and claims the slot, which fell due before that epoch was born",
        "claims_respect_floor",
    ),
    "gate_adopts_headerless_only": _variant(
        STORE_LOSS,
        "S2",
        "the job ends while its message waits in a worker; the store loses its "
        "data, and the gate adopts our own message: the job runs again",
        "gate_adopts_headerless_only",
    ),
    "resubmit_republishes": _variant(
        ENQUEUE_SQL,
        "L",
        "the create applies, its answer is lost and cannot be read back; the "
        "caller submits again and finds the job, whose message is never sent",
        "resubmit_republishes",
    ),
    "gate_reads_back_its_write": _variant(
        ENQUEUE,
        "L",
        "the gate's write applies and its answer is lost; the delivery is requeued "
        "as it came, finds the job RUNNING under a run it holds no ticket for, and "
        "is acked unrun",
        "gate_reads_back_its_write",
    ),
    "dispatched_write_read_back": _variant(
        ENQUEUE,
        "L",
        "a Celery retry's DISPATCHED write applies and its answer is lost; failing "
        "closed, the worker publishes nothing, and the next attempt never runs",
        "dispatched_write_read_back",
    ),
    "outcome_checks_run_id": _variant(
        RERUN,
        "S4",
        "the reconciler re-runs a job whose body still runs; the old run's "
        "outcome, on the state alone, lands on the new attempt's run",
        "outcome_checks_run_id",
    ),
    "atomic": _variant(ATOMIC, None, "an atomic job: gate, effects and outcome in one commit"),
    "atomic_running_in_transaction": _variant(
        ATOMIC,
        "E3",
        "the gate commits RUNNING before the body: the reconciler times out the "
        "RUNNING job (as it must one whose worker died mid-body, rolling the effects "
        "back, since the gate refuses the redelivery), and the effects never commit",
        "atomic_running_in_transaction",
    ),
    "atomic_outcome_with_effects": _variant(
        ATOMIC,
        "E2",
        "the effects commit with RUNNING and the outcome is written after them: the "
        "reconciler times out a RUNNING job whose effects committed (a crash in "
        "between leaves one)",
        "atomic_outcome_with_effects",
    ),
}

#: The variants that keep every rule: each must pass.
BASELINES = tuple(name for name, variant in VARIANTS.items() if variant.breaks is None)


def run(name: str, bounds: Bounds | None = None) -> Result:
    """Search the named variant, within ``bounds`` (by default its own small ones)."""
    variant = VARIANTS[name]
    return search(Model(variant.rules, variant.scenario, bounds or variant.bounds))
