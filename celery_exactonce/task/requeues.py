"""``Reject(requeue=True)`` in a gated body: the job's next attempt, published; the message acked.

Giving the message itself back would only meet the gate again (its attempt
has run). The job moves to its next attempt first, as a retry does, then a
copy is published for it, at the back of the queue; its body sees it
redelivered (:data:`~celery_exactonce.dispatch.messages.HEADER_REQUEUED`). Only with
``acks_late``, as in Celery: a message acked on receipt cannot go back. Each
requeue is a retry: past ``max_retries`` the job ends ``FAILED`` and the task
raises ``MaxRetriesExceededError``, where Celery would give the message back
forever.

Not here: the next attempt's write and its publish (the task's retry path,
handed in as ``next_attempt``), the delivery's own writes
(:mod:`~celery_exactonce.task.gate`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NoReturn

from celery.exceptions import Ignore, Reject

from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from celery_exactonce.dispatch import messages
from celery_exactonce.observe import metrics
from celery_exactonce.task.gate import Delivery


def requeue(
    task: Any,
    ref: JobRef,
    attempt: int,
    delivery: Delivery,
    exc: Reject,
    next_attempt: Callable[..., object],
) -> NoReturn:
    """Run ``ref`` again as its next attempt, or fail it.

    ``next_attempt(reason=…, requeued=True)`` writes the next attempt and
    publishes its copy.

    Raises Celery's ``Ignore`` once the next attempt is written and published
    (this message is acked, its result untouched), or the task's
    ``MaxRetriesExceededError`` once ``attempt`` has reached ``max_retries``.
    """
    if task.max_retries is not None and attempt >= task.max_retries:
        why = f"requeue refused: out of retries (max_retries={task.max_retries})"
        metrics.event(
            "requeues_exhausted",
            f"{task.name} rejected {ref} with requeue on attempt {attempt}: {why}",
            level=logging.WARNING,
            job_id=ref.id,
            task=task.name,
        )
        delivery.finish(State.FAILED, f"rejected: {exc.reason}; {why}")
        raise task.MaxRetriesExceededError(
            f"Can't requeue {task.name}[{task.request.id}]: {why}",
            task_args=task.request.args,
            task_kwargs=task.request.kwargs,
        ) from exc
    metrics.event(
        "requeued",
        f"{task.name} rejected {ref} with requeue: running it again as attempt {attempt + 1}",
        job_id=ref.id,
        task=task.name,
    )
    next_attempt(reason=f"requeued: {exc.reason}", requeued=True)
    raise Ignore()


def show_redelivered(request: Any, headers: Any) -> None:
    """A requeue's copy (its header says so) is a redelivery to the body, as a broker's is."""
    if headers.get(messages.HEADER_REQUEUED):
        request.delivery_info = {**dict(request.delivery_info or {}), "redelivered": True}
