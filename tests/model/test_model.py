"""The model of one job's life: the design passes, each rule it needs fails without it.

Also: the model's transitions match ``celery_exactonce.core.states`` (an edge
planted in that table makes the comparison fail), the full matrix widens
every variant's bounds, and the model imports ``celery_exactonce`` in one
module only.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from pathlib import Path

import pytest

from . import __main__ as cli
from ._table import State, states
from .scope import BASELINES, MODELLED, OUT_OF_SCOPE, VARIANTS, differences, run, table_edges
from .world import Result, Rules

HERE = Path(__file__).parent


@functools.cache
def _result(name: str) -> Result:
    return run(name)


@pytest.mark.parametrize("name", BASELINES)
def test_the_design_passes_every_property_within_the_bounds(name: str) -> None:
    result = _result(name)
    assert result.violation is None, "\n".join(result.trace)
    assert result.stuck == []
    assert result.states > 1_000  # the search did explore


def test_the_baselines_take_every_modelled_edge_and_no_other() -> None:
    taken = set().union(*(_result(name).edges for name in BASELINES))
    assert taken == MODELLED


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
    "claims_carry_epoch": ["THE STORE LOSES ITS DATA", "claims under epoch 0"],
    "claims_respect_floor": ["THE STORE LOSES ITS DATA", "restarts", "claims under epoch 1"],
    "gate_adopts_headerless_only": ["THE STORE LOSES ITS DATA", "gate: no record, adopts"],
    "resubmit_republishes": ["cannot read back", "to publish after: refused", "->TIMEOUT"],
    "gate_reads_back_its_write": [
        "applied, then the store timed out",
        "-> suppressed",
        "->TIMEOUT",
    ],
    "dispatched_write_read_back": ["retry CAS RUNNING", "applied, then the store timed out"],
    # (W1's write on its old run: its retry, or its outcome, whichever the search meets first)
    "outcome_checks_run_id": ["re-run CAS RUNNING", "W2 gate", "CAS RUNNING run3->"],
    "atomic_running_in_transaction": ["gate CAS DISPATCHED->RUNNING run2 (committed)", "->TIMEOUT"],
    "atomic_outcome_with_effects": ["BODY STARTS", "commits the effects", "->TIMEOUT"],
}


@pytest.mark.parametrize("name", sorted(SHOWS))
def test_a_variant_that_drops_a_rule_fails_with_a_shortest_trace(name: str) -> None:
    variant = VARIANTS[name]
    assert variant.breaks is not None
    result = _result(name)
    assert result.violation is not None
    assert result.violation.startswith(f"{variant.breaks}:")
    assert result.trace, "a violation comes with its trace"
    assert result.trace[-1].endswith(f"<- {result.violation}")  # the last step shows it
    assert not any("<-" in step for step in result.trace[:-1])
    for shown in SHOWS[name]:
        assert any(shown in step for step in result.trace), (shown, result.trace)
    if name == "send_back_tickets_need_takeover":  # two deliveries ran on one ticket
        assert sum("owns the run outright" in step for step in result.trace) == 2
    if variant.scenario.losses:  # the loss comes before the step that breaks
        assert "LOSES" not in result.trace[-1]
        assert any("LOSES" in step for step in result.trace[:-1])


def test_every_rule_has_its_variant() -> None:
    names = {field.name for field in dataclasses.fields(Rules)}
    assert names == set(VARIANTS) - set(BASELINES) == set(SHOWS)
    for name in names:
        assert VARIANTS[name].rules == dataclasses.replace(Rules(), **{name: False})
    assert all(VARIANTS[name].rules == Rules() for name in BASELINES)


def test_the_full_matrix_widens_every_variant_s_bounds() -> None:
    for name, variant in VARIANTS.items():
        small = dataclasses.astuple(variant.bounds)
        wider = [dataclasses.astuple(wide) for wide in variant.full]
        assert small not in wider, name
        assert any(all(w >= s for w, s in zip(wide, small, strict=True)) for wide in wider), name


def test_the_command_line_prints_verdicts_and_exits_0_when_each_is_expected(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["--variant", "dispatched_written_before_publish", "--trace"]) == 0
    out = capsys.readouterr().out
    assert "dispatched_written_before_publish [faults=2" in out
    assert "FAIL S3 in 2 steps" in out
    assert " 2. D1 publishes m(att0): ok" in out
    assert "unexpected: 0" in out


def test_the_command_line_exits_1_on_a_verdict_not_expected(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    variant = VARIANTS["dispatched_written_before_publish"]
    planted = dataclasses.replace(variant, breaks=None)
    monkeypatch.setitem(VARIANTS, "dispatched_written_before_publish", planted)
    assert cli.main(["--variant", "dispatched_written_before_publish"]) == 1
    assert "UNEXPECTED: expected PASS" in capsys.readouterr().out


def test_the_model_knows_every_transition_states_py_allows() -> None:
    assert differences() == []
    assert table_edges() >= MODELLED
    assert not MODELLED & set(OUT_OF_SCOPE)


def test_a_transition_planted_in_states_py_fails_the_comparison(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(states.ALLOWED, State.TIMEOUT, frozenset({State.RUNNING}))
    assert differences() == [
        "core/states.py allows TIMEOUT -> RUNNING, which the model neither performs nor leaves "
        "out by name"
    ]


def test_a_creatable_state_planted_in_states_py_fails_the_comparison(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(states, "CREATABLE", states.CREATABLE | {State.DISPATCHED})
    assert differences() == [
        "core/states.py allows (none) -> DISPATCHED, which the model neither performs nor leaves "
        "out by name"
    ]


def test_an_edge_removed_from_states_py_fails_the_comparison(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    without = states.ALLOWED[State.RUNNING] - {State.RUNNING}
    monkeypatch.setitem(states.ALLOWED, State.RUNNING, without)
    known = "the model knows RUNNING -> RUNNING, which core/states.py does not allow"
    assert differences() == [known]


def test_a_next_attempt_edge_removed_from_states_py_fails_the_comparison(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    edges = states.NEXT_ATTEMPT_EDGES - {(State.RUNNING, State.PENDING)}
    monkeypatch.setattr(states, "NEXT_ATTEMPT_EDGES", edges)
    attempt = "the model's next attempt RUNNING -> PENDING is not one in core/states.py"
    assert differences() == [attempt]


def test_the_model_imports_celery_exactonce_in_one_module_only() -> None:
    importing = set()
    for path in sorted(HERE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            if any(name.split(".")[0] == "celery_exactonce" for name in names):
                importing.add(path.name)
    assert importing == {"_table.py"}


def test_each_module_of_the_model_is_short_and_says_what_it_holds() -> None:
    for path in sorted(HERE.glob("*.py")):
        text = path.read_text()
        assert len(text.splitlines()) <= 420, path.name
        assert ast.get_docstring(ast.parse(text)), path.name


@pytest.mark.slow
@pytest.mark.timeout(1800)  # ~9 minutes on two busy cores, more when the chaos tests share them
def test_the_design_passes_with_wider_bounds() -> None:
    """The full matrix (``tox -e model``): each scenario passes and each variant fails, wider."""
    assert cli.main(["--full", "--jobs", "2"]) == 0
