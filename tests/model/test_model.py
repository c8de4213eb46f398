"""The model of one job's life: the design passes, each rule it needs fails without it.

Also: the model's transitions match ``celery_exactonce.core.states``, and an edge
planted in that table makes the comparison fail.
"""

from __future__ import annotations

import dataclasses

import pytest

from celery_exactonce.core import states
from celery_exactonce.core.states import State

from .checker import Bounds, Rules
from .scope import MODELLED, OUT_OF_SCOPE, VARIANTS, differences, run, table_edges


def test_the_design_passes_every_property_within_the_bounds() -> None:
    result = run("baseline")
    assert result.violation is None, "\n".join(result.trace)
    assert result.stuck == []
    assert result.states > 10_000  # the search did explore
    assert result.edges == MODELLED  # every modelled edge is reached, and nothing else


#: Steps each variant's counterexample must show (the rule it drops at work).
SHOWS = {
    "gate_checks_attempt": ["retry CAS RUNNING", "crashes", "BODY STARTS (attempt 0)"],
    "send_back_tickets_need_takeover": [
        "cannot read back",
        "sends back",
        "broker duplicates",
        "owns the run outright",
    ],
    "dispatched_written_before_publish": ["publishes m(att0)"],
    "reconciler_uses_rev_cas": ["R lists SCHEDULED", "rolls back", "R replay CAS"],
}


@pytest.mark.parametrize("name", sorted(SHOWS))
def test_a_variant_that_drops_a_rule_fails_with_a_shortest_trace(name: str) -> None:
    variant = VARIANTS[name]
    assert variant.breaks is not None
    result = run(name)
    assert result.violation is not None
    assert result.violation.startswith(f"{variant.breaks}:")
    assert result.trace, "a violation comes with its trace"
    assert result.trace[-1].endswith(f"<- {result.violation}")  # the last step shows it
    assert not any("<-" in step for step in result.trace[:-1])
    for shown in SHOWS[name]:
        assert any(shown in step for step in result.trace), (shown, result.trace)
    if name == "send_back_tickets_need_takeover":  # two deliveries ran on one ticket
        assert sum("owns the run outright" in step for step in result.trace) == 2


def test_every_rule_has_its_variant() -> None:
    names = {field.name for field in dataclasses.fields(Rules)}
    assert names == set(VARIANTS) - {"baseline"} == set(SHOWS)
    for name in names:
        assert VARIANTS[name].rules == dataclasses.replace(Rules(), **{name: False})


def test_the_model_knows_every_transition_states_py_allows() -> None:
    assert differences() == []
    assert table_edges() >= MODELLED
    assert not MODELLED & set(OUT_OF_SCOPE)


def test_a_transition_planted_in_states_py_fails_the_comparison(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(states.ALLOWED, State.TIMEOUT, frozenset({State.RUNNING}))
    assert differences() == [
        "states.py allows TIMEOUT -> RUNNING, which the model neither performs nor leaves "
        "out by name"
    ]


def test_a_creatable_state_planted_in_states_py_fails_the_comparison(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(states, "CREATABLE", states.CREATABLE | {State.DISPATCHED})
    assert differences() == [
        "states.py allows (none) -> DISPATCHED, which the model neither performs nor leaves "
        "out by name"
    ]


def test_an_edge_removed_from_states_py_fails_the_comparison(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    without = states.ALLOWED[State.RUNNING] - {State.RUNNING}
    monkeypatch.setitem(states.ALLOWED, State.RUNNING, without)
    assert differences() == ["the model knows RUNNING -> RUNNING, which states.py does not allow"]


@pytest.mark.slow
def test_the_design_passes_with_wider_bounds() -> None:
    result = run("baseline", Bounds(faults=3, passes=2))
    assert result.violation is None, "\n".join(result.trace)
