"""Watching what an app publishes, for the unit tests' in-process worlds."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from celery import Celery, signals

from celery_exactonce import runtime
from celery_exactonce.observe import metrics


@contextlib.contextmanager
def publishing(app: Celery, capture: Callable[..., Any]) -> Iterator[None]:
    """``capture`` sees every message published while inside (Celery's ``before_task_publish``).

    The counters start from zero; on the way out the app's runtime is reset.
    """
    signals.before_task_publish.connect(capture, weak=False)
    metrics.COUNTERS.reset()
    try:
        yield
    finally:
        signals.before_task_publish.disconnect(capture)
        runtime.reset(app)


@contextlib.contextmanager
def recording(app: Celery, sent: list[tuple[str, dict[str, Any]]]) -> Iterator[None]:
    """:func:`publishing`, each message's task id and headers appended to ``sent``."""

    def capture(sender: Any = None, headers: Any = None, **_kw: Any) -> None:
        sent.append((headers["id"], dict(headers)))

    with publishing(app, capture):
        yield
