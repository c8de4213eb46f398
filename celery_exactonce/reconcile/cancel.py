"""Acting on jobs from application code: :func:`cancel`."""

from __future__ import annotations

from typing import Any

from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.core.writes import Transition
from celery_exactonce.runtime import runtime_for
from celery_exactonce.stores import settle

#: The states a job can be cancelled from: not dispatched yet.
CANCELLABLE = frozenset({State.PENDING, State.SCHEDULED})


def cancel(task_id: str, app: Any = None) -> bool:
    """Cancel the job ``task_id`` if it has not been dispatched yet; return whether it did.

    A delayed job waiting ``PENDING`` (or a job ``SCHEDULED`` and not yet
    published) ends ``CANCELLED`` and never runs. A job already dispatched,
    running or finished is left as it is (``False``); revoke a dispatched one
    with Celery's ``revoke``, which the gate records as ``CANCELLED``.

    Raises
    ------
    StoreError
        The store could not be reached, or the write's outcome is unknown and
        could not be read back. Calling again is safe.
    """
    if app is None:
        from celery import current_app

        app = current_app._get_current_object()  # the app itself: the registry keys it weakly
    runtime = runtime_for(app)
    ref = JobRef.submitted(task_id)
    request = Transition(
        State.CANCELLED, CANCELLABLE, node=runtime.node, reason="cancelled by cancel()"
    )
    result = settle.transition(runtime.store, ref, request)
    if result.error is not None and not result.applied:
        raise result.error
    return result.applied
