"""Unit-test defaults."""

from __future__ import annotations

import pytest

from celery_exactonce.beat.scheduler import ExactOnceScheduler


@pytest.fixture(autouse=True)
def _reconcile_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Beat nodes run their reconcile passes inside the tick: frozen clocks stay deterministic."""
    monkeypatch.setattr(ExactOnceScheduler, "reconcile_in_thread", False)
