"""Counters, log events and Sentry reports."""

from __future__ import annotations

from typing import Any

from celery_exactonce import metrics


def test_event_counts_by_the_given_amount() -> None:
    metrics.COUNTERS.reset()
    metrics.event("slot_skipped", "skipped", labels={"where": "catchup"}, count=7)
    metrics.event("slot_skipped", "skipped", labels={"where": "store_loss"})
    assert metrics.COUNTERS.get("slot_skipped", where="catchup") == 7
    assert metrics.COUNTERS.get("slot_skipped") == 8


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
        dsn="https://key@sentry.invalid/1", transport=Capture(),
        default_integrations=False, auto_enabling_integrations=False,
    )  # fmt: skip
    try:
        metrics.event("rollback_failed", "boom", labels={"phase": "rollback_write"},
                      sentry=True, job_id="j-1")  # fmt: skip
        sentry_sdk.flush(timeout=5)
    finally:
        sentry_sdk.init(dsn=None)
    assert len(events) == 1
