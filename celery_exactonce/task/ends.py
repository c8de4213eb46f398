"""How a gated run ends: what Celery's exceptions out of the body mean for its job.

The body of a delivery past the gate runs here (:func:`run`), and each way
it can leave is written in the job's record before Celery sees it: a
``Retry`` is the next attempt already (written when the body asked for it),
``Ignore`` ends the job ``CANCELLED`` (or ``SUCCEEDED``, replaced by the job
``self.replace()`` submitted), ``Reject`` and any other exception
``FAILED`` (a ``Reject(requeue=True)`` under ``acks_late`` first makes the
next attempt). A body that returns is the caller's to end (its outcome may
be carried, or committed with the body's effects).

Not here: the gate (:mod:`~celery_exactonce.task.gate`, and
:mod:`~celery_exactonce.task.atomic` for an atomic run), the writes about
the job's future (``ExactOnceTask``'s retry and replacement).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from celery.exceptions import Ignore, Reject, Retry

from celery_exactonce.core.states import State
from celery_exactonce.task import atomic, requeues
from celery_exactonce.task.gate import Delivery


def run(task: Any, delivery: Delivery, gated: Any, body: Callable[[], Any]) -> Any:
    """``body()``, the run ``gated`` of ``delivery``; its exception written first.

    An :class:`~celery_exactonce.task.atomic.NotRun` (nothing of an atomic run
    committed) writes nothing.
    """
    request = task.request
    try:
        return body()
    except Retry as exc:
        if request.is_eager:  # Celery runs the retry itself, once this run has ended
            task._retry_eagerly(gated, exc)
        raise  # in a worker, the retry already made this the next attempt of the job
    except Ignore:
        if gated.replaced_by is not None:
            delivery.finish(State.SUCCEEDED, f"replaced by {gated.replaced_by}")
        else:
            delivery.finish(State.CANCELLED, "the body raised Ignore")
        raise
    except Reject as exc:
        if exc.requeue and task.acks_late and not request.is_eager:
            # (acked at once, a message cannot go back; nor can an eager run)
            again = functools.partial(task._retry_next_attempt, gated, None, None, {})
            requeues.requeue(task, gated.ref, gated.attempt, delivery, exc, again)
        delivery.finish(State.FAILED, f"rejected: {exc.reason}")
        raise
    except atomic.NotRun:
        raise
    except BaseException as exc:
        delivery.finish(State.FAILED, f"{type(exc).__name__}: {exc}")
        raise
