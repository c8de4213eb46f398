"""The atomic gate: a gated body's effects and its outcome commit in one transaction.

A task with ``exactonce_atomic = True`` whose store is the database its body
writes to runs each delivery inside one transaction on that database: the
gate's CAS ``SCHEDULED/DISPATCHED → RUNNING``, the body, and ``RUNNING →
SUCCEEDED``, then the commit. The body writes in that transaction through
``self.request.exactonce.connection`` (:class:`AtomicRun`): on a
``django://ALIAS`` store, Django's connection of the alias, which the ORM
uses anyway; on a ``postgresql://``, ``mysql://`` or ``sqlite://`` store, a
SQLAlchemy connection of the store's engine. The job's row, updated by the
gate, stays locked until then: a second delivery's gate waits for it, and
finds the job ended. Nobody else sees the job ``RUNNING``; the body's rows
and the job's end appear together, or neither does:

* the body raises: the transaction rolls back (its rows go), then the run's
  end is written as any gated run's (``FAILED``, or the next attempt of a
  retry), the gate's ``RUNNING`` committed first;
* the worker dies, or the commit fails: nothing of the run committed, and the
  job is as it was before the delivery. The message comes back (a
  redelivery, or a send-back) or the reconciler redispatches the job, which
  is safe for an atomic job, and its default (its policy's ``redispatch``);
* a child submitted from the body (``.delay()`` of a gated task) is written
  in the transaction and published once it commits: it exists if and only if
  the parent's effects do.

Effects outside the database (a request to another service, an email) are
not part of the transaction: at most once per attempt, as for any gated task.

Not here: the plain gate (:mod:`~celery_exactonce.task.gate`), what wraps the
body (``ExactOnceTask.__call__``), the transactional submit
(:func:`celery_exactonce.task.submit.after_commit`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from celery.exceptions import Ignore, Reject

from celery_exactonce.core import exceptions
from celery_exactonce.core.states import State
from celery_exactonce.observe import metrics
from celery_exactonce.task import later, outcomes
from celery_exactonce.task.gate import Delivery

#: The history reason of an atomic run's end, committed with its effects.
COMMITTED = "body returned (committed with its effects)"


@dataclasses.dataclass(frozen=True)
class AtomicRun:
    """``self.request.exactonce`` in the body of an atomic run."""

    #: The connection of the run's transaction: Django's connection of the store's
    #: alias (``django://``), or a SQLAlchemy ``Connection`` of the SQL store's engine.
    #: What the body writes through it commits with the job's end, or not at all.
    connection: Any


class NotRun(Exception):
    """Nothing of this delivery's run committed, and nothing is to be written for it:
    the worker raises :attr:`raised` (``Ignore``, ``Reject``, or what stopped the
    worker) as it is."""

    def __init__(self, raised: BaseException) -> None:
        super().__init__(str(raised))
        self.raised = raised


def check_store(task: Any, store: Any) -> None:
    """Refuse ``exactonce_atomic`` where the body's writes cannot share the job's transaction.

    Only a store in a database the body can write to, whose ``transaction``
    spans the gate, the body and the outcome (a SQL or ``django://`` store),
    can. Raises :class:`~celery_exactonce.core.exceptions.ConfigurationError`.
    """
    if getattr(store, "transaction", None) is None:
        raise exceptions.ConfigurationError(
            f"{task.name}: exactonce_atomic needs the job store in the database the body "
            f"writes to, a SQL or django:// store (exactonce_store_url names "
            f"{type(store).__name__})",
            setting="exactonce_store_url",
        )


def run_body(
    task: Any, delivery: Delivery, run: Any, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Any:
    """Pass the gate, run the body and write its end, in one transaction; the body's result.

    ``run.later``: the writes about the job's future the body asks for inside
    the transaction (a retry's next attempt, a replacement), made once it has
    rolled back, after the gate's ``RUNNING`` is committed; the caller then
    writes the run's end for the body's exception as for any gated run.
    Raises :class:`NotRun` (nothing to write) for a delivery the job does not
    wait for (``Ignore``), for a run whose transaction did not commit
    (``Ignore``; ``Reject(requeue=True)`` with ``acks_late``: the message goes
    back), and for a worker going down (what stopped it).
    """
    runtime = delivery.runtime
    outcomes.write_carried(runtime)  # this thread's last outcome: not in this transaction
    stage = "gate"
    try:
        with runtime.store.transaction() as connection:  # type: ignore[attr-defined]
            task.request.exactonce = AtomicRun(connection)
            _enter(delivery)
            stage = "body"
            result = task.run(*args, **kwargs)
            stage = "end"
            delivery.finish(State.SUCCEEDED, COMMITTED)
    except BaseException as exc:
        if stage == "body" and isinstance(exc, Exception):
            # Rolled back: nothing of the run committed. Its end is a gated run's own.
            try:
                delivery.enter(args, kwargs, brief=True)
            except (Ignore, Reject) as refused:  # the job moved on meanwhile
                raise NotRun(refused) from exc
            run.run_id = delivery.run_id  # (another, if the gate had to send itself back)
            later.make(run.later)
            raise
        if stage == "gate" and not isinstance(exc, exceptions.StoreError):
            raise NotRun(exc) from None  # Ignore: not this delivery's to run
        if stage == "end" and isinstance(exc, Exception) and _committed(delivery):
            return result  # the commit's answer was lost, not the commit
        if isinstance(exc, Exception):
            raise NotRun(_not_committed(task, delivery, exc)) from exc
        raise NotRun(exc) from None  # the worker is going down: the job is as it was
    return result


def _enter(delivery: Delivery) -> None:
    """The gate's CAS, inside the transaction: ``Ignore`` unless it applied.

    It waits for the row lock of a transaction that holds the job (another
    delivery's), then applies only if that one did not commit. Brief: the
    record is read only for a delivery it refuses.
    """
    store, ref = delivery.runtime.store, delivery.ref
    write = delivery.gate_write("gate (atomic)")
    result = store.transition_many([(ref, write)], brief=True)[0]
    if not result.applied:
        delivery.refuse(result.job if result.job is not None else store.get(ref))


def _committed(delivery: Delivery) -> bool:
    """Whether the run's transaction committed after all (its end is in the record)."""
    try:
        job = delivery.runtime.store.get(delivery.ref)
    except exceptions.StoreError:
        return False  # unknown: as if not (the gate of the next delivery decides)
    return job is not None and job.state is State.SUCCEEDED and job.run_id == delivery.run_id


def _not_committed(task: Any, delivery: Delivery, exc: Exception) -> BaseException:
    """What the worker raises for a run whose transaction did not commit (nothing of it
    did): its message back (``acks_late``), or left to the reconciler's redispatch."""
    back = task.acks_late and not task.request.is_eager
    metrics.event(
        "atomic_rolled_back",
        f"atomic run of {delivery.ref} did not commit ({type(exc).__name__}: {exc}): "
        + ("its message goes back" if back else "the reconciler redispatches the job"),
        level=logging.WARNING,
        job_id=delivery.ref.id,
        task=task.name,
    )
    raised: BaseException = Reject(exc, requeue=True) if back else Ignore()
    return raised
