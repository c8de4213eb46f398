"""``celery_exactonce.core.writes``: a transition's remembered check answers as the first did."""

from __future__ import annotations

import pytest

from celery_exactonce.core import exceptions
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import Transition


def test_a_transition_refuses_an_edge_the_table_does_not_have_every_time() -> None:
    for _ in range(2):  # the second answer comes from the remembered check
        with pytest.raises(exceptions.InvalidRequest, match="SUCCEEDED → PENDING"):
            Transition(State.PENDING, [State.SUCCEEDED], node="n", reason="r")
    request = Transition(State.RUNNING, ["DISPATCHED"], node="n", reason="r", new_run_id="x")
    assert request.expect == frozenset({State.DISPATCHED})
