"""Handing a gated task one delivery the way Celery's worker does, for the unit tests."""

from __future__ import annotations

import uuid
from typing import Any

from celery import Celery
from celery.exceptions import Ignore, Reject, Retry

from celery_exactonce import runtime
from celery_exactonce.stores.base import StateStore
from celery_exactonce.task.base import ExactOnceTask


def django_store_app(name: str, alias: str) -> tuple[Celery, StateStore]:
    """An app on a memory broker and the ``django://`` store of ``alias``, set up, in a
    namespace of its own (the store's rows outlive Django's flush)."""
    app = Celery(name, broker="memory://", set_as_current=False)
    namespace = f"{name}-{uuid.uuid4().hex[:8]}"
    app.conf.update(exactonce_store_url=f"django://{alias}", exactonce_namespace=namespace)
    store = runtime.runtime_for(app).store
    store.setup()
    return app, store


def deliver_to(
    gated: ExactOnceTask, task_id: str, headers: dict[str, Any], *, redelivered: bool = False
) -> str:
    """Push a request on ``gated``, call it: ran, ignored, sent_back or requeued.

    ``headers`` are the message's (protocol 2: Celery's own fields, ours beside them).
    """
    retries = int(headers.get("retries", headers.get("exactonce_attempt", 0)))
    ours = {
        k: v for k, v in headers.items() if k.startswith("exactonce_") or k == "idempotency_key"
    }
    gated.push_request(
        id=task_id,
        args=[1],
        kwargs={},
        retries=retries,
        headers=ours,
        is_eager=False,
        called_directly=False,
        delivery_info={"redelivered": redelivered},
        **ours,
    )
    try:
        gated(1)
    except Ignore:
        return "ignored"
    except Retry:
        return "sent_back"
    except Reject:
        return "requeued"
    finally:
        gated.pop_request()
    return "ran"
