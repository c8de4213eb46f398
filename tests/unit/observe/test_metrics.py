"""Counters, log events and Sentry reports."""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path
from typing import Any

import pytest

import celery_exactonce
from celery_exactonce.observe import metrics


def test_event_counts_by_the_given_amount() -> None:
    metrics.COUNTERS.reset()
    metrics.event("slot_skipped", "skipped", labels={"where": "catchup"}, count=7)
    metrics.event("slot_skipped", "skipped", labels={"where": "store_loss"})
    assert metrics.COUNTERS.get("slot_skipped", where="catchup") == 7
    assert metrics.COUNTERS.get("slot_skipped") == 8


def test_a_label_set_counts_under_one_key_however_often_and_in_whatever_order_it_comes() -> None:
    # Given one label set, the second time remembered, and the same in another order
    counters = metrics.Counters()
    for labels in (
        {"task": "t", "where": "w"},
        {"task": "t", "where": "w"},
        {"where": "w", "task": "t"},
    ):
        counters.incr("dispatched", labels)
    # And labels that are no counter's, empty, or not text
    counters.incr("dispatched", {"task": "t", "where": "w", "job_id": "j-1", "entry": ""})
    counters.incr("dispatched", {"task": "t", "where": ["w"]})  # type: ignore[dict-item]
    counters.incr("dispatched", {"state": 1})  # type: ignore[dict-item]
    counters.incr("dispatched", {"state": True})  # type: ignore[dict-item]
    # Then each is the counter its sorted text labels name
    assert counters.snapshot() == {
        "dispatched{state=1}": 1,
        "dispatched{state=True}": 1,
        "dispatched{task=t,where=['w']}": 1,
        "dispatched{task=t,where=w}": 4,
    }


def test_failed_rollback_reaches_sentry_when_the_app_initialised_it() -> None:
    import sentry_sdk
    from sentry_sdk.transport import Transport

    events: list[Any] = []

    class Capture(Transport):  # type: ignore[misc]
        def capture_envelope(self, envelope: Any) -> None:
            events.append(envelope)

    # Not initialised: nothing is sent
    assert not metrics.report_to_sentry("rollback_failed", "boom", {})
    sentry_sdk.init(
        dsn="https://key@sentry.invalid/1",
        transport=Capture(),
        default_integrations=False,
        auto_enabling_integrations=False,
    )
    try:
        metrics.event(
            "rollback_failed", "boom", labels={"phase": "rollback_write"}, sentry=True, job_id="j-1"
        )
        sentry_sdk.flush(timeout=5)
    finally:
        sentry_sdk.init(dsn=None)
    assert len(events) == 1


def test_an_event_that_is_also_a_broader_one_is_one_record_and_both_counters(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics.COUNTERS.reset()
    with caplog.at_level(logging.WARNING, logger="celery_exactonce"):
        metrics.event(
            "publish_rolled_back",
            "refused",
            level=logging.WARNING,
            labels={"phase": "publish"},
            also=("fail_closed",),
        )
    assert metrics.COUNTERS.get("publish_rolled_back", phase="publish") == 1
    assert metrics.COUNTERS.get("fail_closed", phase="publish") == 1
    (record,) = caplog.records
    assert (record.action, record.also) == ("publish_rolled_back", ["fail_closed"])  # type: ignore[attr-defined]


def test_an_event_below_the_log_level_is_still_counted(caplog: pytest.LogCaptureFixture) -> None:
    metrics.COUNTERS.reset()
    with caplog.at_level(logging.INFO, logger="celery_exactonce"):
        metrics.event("dispatched", "sent", level=logging.DEBUG)
    assert metrics.COUNTERS.get("dispatched") == 1 and caplog.records == []


def _calls(tree: ast.AST) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)]


def test_every_counted_or_logged_event_goes_through_metrics_event() -> None:
    """One path: no module but ``metrics`` logs an ``action`` or bumps a counter itself."""
    package = Path(celery_exactonce.__file__).parent
    offenders = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "metrics.py" or "demo" in path.parts:
            continue
        for call in _calls(ast.parse(path.read_text(encoding="utf-8"))):
            func = call.func
            if not isinstance(func, ast.Attribute):
                continue
            bumps = func.attr == "incr" and ast.unparse(func.value).endswith("COUNTERS")
            logs = isinstance(func.value, ast.Name) and func.value.id == "logger"
            if bumps or logs:
                offenders.append(f"{path.relative_to(package)}:{call.lineno} {ast.unparse(func)}")
    assert offenders == []


def test_every_event_the_package_emits_is_in_the_events_reference() -> None:
    """docs/reference/events.md has a row for each action ``metrics.event`` is called with."""
    package = Path(celery_exactonce.__file__).parent
    actions = set()
    for path in package.rglob("*.py"):
        if "demo" in path.parts:
            continue
        for call in _calls(ast.parse(path.read_text(encoding="utf-8"))):
            func = call.func
            named = isinstance(func, ast.Attribute) and func.attr == "event" and call.args
            if named and isinstance(call.args[0], ast.Constant):
                actions.add(call.args[0].value)
    reference = (package.parent / "docs" / "reference" / "events.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^\| `(\w+)` \|", reference, re.MULTILINE))
    assert len(actions) > 20
    assert sorted(actions - documented) == []


def test_an_events_arguments_are_formatted_into_its_record(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics.COUNTERS.reset()
    with caplog.at_level(logging.DEBUG, logger="celery_exactonce"):
        metrics.event("dispatched", "job %s published (attempt %s)", "t:j1", 2, level=logging.DEBUG)
    (record,) = caplog.records
    assert record.getMessage() == "job t:j1 published (attempt 2)"
    assert metrics.COUNTERS.get("dispatched") == 1
