"""Writes about the running job's future that wait until the body has ended.

On the ``django://`` store every write goes through the thread's Django
connection, so inside the body's own ``transaction.atomic()`` it is part of the
body's transaction. A retry (``self.retry()``) and a replacement
(``self.replace()``) raise out of that block, which rolls back: written there,
the next attempt or the replacement's record would be undone while its
message was published (or, for the replacement, never publish, the gate ending
the job ``SUCCEEDED`` for a replacement that does not exist).

So while the body holds a transaction open on the store's connection, the gate
keeps such a write (:func:`made_now` says when) and makes it once the body has
ended (:func:`run_body`), whatever its blocks did: then it commits at once,
before its message is published, as everywhere else. Another connection could
not take it earlier: on SQLite it would wait for the write lock the body's own
transaction holds.

Not here: the writes themselves (:mod:`~celery_exactonce.task.base`), the
transactional submit of other jobs, which does belong to the caller's
transaction (:func:`celery_exactonce.task.submit.after_commit`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from celery.exceptions import Reject

from celery_exactonce.runtime import Runtime
from celery_exactonce.task import submit


def made_now(runtime: Runtime) -> bool:
    """Whether a write about the running job's future may be made now, or must wait.

    It waits while a transaction is open on the store's connection: only the
    body's can be, in a worker (the gate's own writes are each committed).
    """
    return submit.after_commit(runtime) is None


def run_body(
    body: Callable[..., Any],
    later: list[Callable[[], object]],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> Any:
    """Run ``body``, then the writes it left in ``later``, in order, however it ended.

    A write that fails raises in place of the body's outcome (the gate then
    ends the job as for that error); the ones after it are not made.
    """
    try:
        return body(*args, **kwargs)
    finally:
        make(later)


def make(later: list[Callable[[], object]]) -> None:
    """Make the writes left in ``later``, in order, emptying it; one that fails raises,
    and the ones after it are not made."""
    while later:
        later.pop(0)()


def as_celery_retry(write: Callable[[], object]) -> Callable[[], None]:
    """``write`` (a retry's), failing as Celery's ``retry`` fails to publish: ``Reject``.

    Celery turns an error of the retry's publish into ``Reject(requeue=False)``,
    which ends the job ``FAILED``; a retry made later fails the same way.
    """

    def made() -> None:
        try:
            write()
        except Reject:
            raise
        except Exception as exc:
            raise Reject(exc, requeue=False) from exc

    return made
