"""The SQL store's transitions: a guarded compare-and-swap of a record, and notes on it.

:class:`SqlTransitions` is the part of :class:`~celery_exactonce.stores.sql.store.SqlStore`
that decides a transition inside its transaction, with the guards and effects
of :mod:`celery_exactonce.core.jobs`. A transition goes one of two ways:

* **one statement for a batch** (:meth:`SqlTransitions._transition_batch`,
  PostgreSQL): a brief batch of one shape, the one-row statement run for
  every row at once (:mod:`~celery_exactonce.stores.sql.statements_batch`); if
  a row did not apply, the batch is undone (a savepoint) and goes one row at a time;
* **one statement** (:meth:`SqlTransitions._transition_fast`): the guarded
  ``UPDATE`` of :mod:`~celery_exactonce.stores.sql.statements`, whose
  ``WHERE`` holds every guard (the lease included) and whose ``SET`` restates
  :func:`~celery_exactonce.core.jobs.apply_transition`. Not for a transition that
  rewrites the payload. A statement that changed nothing (a guard failed, the
  lease is lost, there is no record, a history it cannot extend) is decided
  again the locking way; one that changed something is never sent again;
* **locking** (:meth:`SqlTransitions._transition`): read the record under a
  lock, check the lease (:meth:`~celery_exactonce.stores.sql.leases.SqlLeases._holds`),
  ask :func:`~celery_exactonce.core.jobs.check_transition`, write what
  :func:`~celery_exactonce.core.jobs.apply_transition` returns.

A batch takes its rows in key order, so two batches never deadlock. A note
(``annotate``) is added to a record's history under the row lock.

Not here: which transaction a transition runs in (autocommit or not, one or
a batch) and the heartbeat (:mod:`~celery_exactonce.stores.sql.store`), the
statements' SQL (:mod:`~celery_exactonce.stores.sql.statements`), leases
(:mod:`~celery_exactonce.stores.sql.leases`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa

from celery_exactonce.core import exceptions, jobs, times
from celery_exactonce.core.jobs import TransitionResult, TransitionStatus
from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import TERMINAL
from celery_exactonce.core.writes import Transition
from celery_exactonce.stores.sql import engine as sql_engine
from celery_exactonce.stores.sql import pgwire
from celery_exactonce.stores.sql.base import Rerun
from celery_exactonce.stores.sql.leases import SqlLeases

#: Transitions of different shapes run together at most (:meth:`SqlTransitions._applied_together`).
TOGETHER = 8


class SqlTransitions(SqlLeases):
    """Transitions and notes, inside their transaction."""

    def _transition_many(
        self, requests: Sequence[tuple[JobRef, Transition]], brief: bool
    ) -> list[TransitionResult]:
        """``transition_many`` of a batch that is not empty.

        A brief batch of transitions one statement can apply, on PostgreSQL
        where a statement alone commits at once (the store's own connections;
        for one transition, Django's in its autocommit, outside any ``atomic``
        block), first runs alone (:meth:`_applied_alone`): each row it changed
        is applied, and only the others are decided, one row at a time in key
        order, in a transaction of their own (the statement's row locks went
        with its commit). Else the batch is one transaction
        (:meth:`_transition_many_op`), a batch of one shape tried first as one
        statement under a savepoint.
        """
        order = sorted(range(len(requests)), key=lambda i: str(requests[i][0]))
        fast = brief and all(self._fast_transition(t) for _, t in requests)
        results: dict[int, TransitionResult] = {}
        rest, batch, tried = order, None, False
        alone = self.owns_transactions or len(requests) == 1  # Django: the gate's writes
        if fast and self._autocommit and alone and self._on_driver():
            applied = self._applied_alone(requests, order)
            if applied is not None:
                results = dict.fromkeys(applied, TransitionResult(TransitionStatus.APPLIED))
                rest, tried = [i for i in order if i not in applied], True
        elif fast:
            batch = self._sql.transition_batch(self._namespace, [requests[i] for i in order])
        if rest:  # tried: the statement left them, and the locking way decides
            op = self._transition_many_op(requests, rest, batch, brief, tried=tried)
            results.update(zip(rest, self._run("transition_many", op), strict=True))
        return [results[i] for i in range(len(requests))]

    def _applied_alone(
        self, requests: Sequence[tuple[JobRef, Transition]], order: Sequence[int]
    ) -> set[int] | None:
        """Which of ``requests`` (brief, fast; ``order``: key order) one statement applied.

        The statement runs alone in autocommit on the driver
        (:meth:`~celery_exactonce.stores.sql.base.SqlCore._run_statement`, one
        round trip): the one-row ``UPDATE`` for one request (on PostgreSQL on a
        kept plan, by its key: :data:`~.pgwire.BY_KEY`), else the batch's
        (``None``: the batch is not one statement, nothing ran). A statement that failed
        with an error after which it may be rerun (a deadlock: a lease's
        ``EXISTS`` locks a second row, which a lock-ordered transaction may
        hold) changed nothing: none applied, and the caller's transaction,
        which reruns, decides them all.
        """
        batch = None
        if len(order) > 1:
            batch = self._sql.transition_batch(self._namespace, [requests[i] for i in order])
        try:
            if len(order) > 1 and batch is None:
                return self._applied_together(requests, order)
            if batch is None:
                ref, request = requests[order[0]]
                stmt, params = self._sql.transition(self._namespace, ref, request, brief=True)
            else:
                stmt, params = batch
            keep = pgwire.BY_KEY if batch is None else None  # one row: its key's plan, kept
            row = self._run_statement("transition_many", stmt, params, keep=keep)
        except exceptions.StoreUnavailable as exc:
            cause = exc.__cause__
            if sql_engine.error_code(getattr(cause, "orig", None) or cause) in self._d.retry:
                return set()
            raise
        if batch is None:
            return set() if row is None else {order[0]}
        return {order[i - 1] for i in row[0] or ()}

    def _applied_together(
        self, requests: Sequence[tuple[JobRef, Transition]], order: Sequence[int]
    ) -> set[int] | None:
        """Which of ``requests`` (brief, fast; of shapes no one statement takes) their
        one-row ``UPDATE`` s applied, run together: on PostgreSQL, each on its key's kept
        plan, in one message and one commit (:func:`~.pgwire.run_kept_many`). ``None``:
        not here (another database, more than :data:`TOGETHER`, a value with no text
        form), nothing ran."""
        if not self._postgresql or len(order) > TOGETHER:
            return None
        with self._guard("transition_many"), self._statement_connection() as (driver, _):
            if not pgwire.keeps(driver):
                return None
            forms = []
            for i in order:
                ref, request = requests[i]
                stmt, params = self._sql.transition(self._namespace, ref, request, brief=True)
                form = pgwire.kept(self._compiled(stmt)[0], pgwire.BY_KEY)
                try:
                    forms.append((form, pgwire.values_of(driver, form, params)))
                except TypeError:
                    return None
            rows = pgwire.run_kept_many(driver, forms)
        return {i for i, answer in zip(order, rows, strict=True) if answer}

    def _transition_many_op(
        self,
        requests: Sequence[tuple[JobRef, Transition]],
        order: Sequence[int],
        batch: tuple[sa.TextClause | sa.TextualSelect, dict[str, Any]] | None,
        brief: bool,
        *,
        tried: bool = False,
    ) -> Callable[[sa.Connection], list[TransitionResult]]:
        """The transaction of the ``requests`` at ``order`` (key order): their results, in
        that order; ``batch``: the statement of them all, tried first under a savepoint;
        ``tried``: their statement ran already (alone), so each goes the locking way."""

        def op(conn: sa.Connection) -> list[TransitionResult]:
            if batch is not None and (applied := self._transition_batch(conn, *batch)):
                return applied
            results = []
            for i in order:
                ref, request = requests[i]
                if tried:
                    results.append(self._transition(conn, ref, request))
                else:
                    results.append(self._transition_one(conn, ref, request, brief=brief))
            return results

        return op

    def _transition_batch(
        self, conn: sa.Connection, stmt: sa.TextClause | sa.TextualSelect, params: dict[str, Any]
    ) -> list[TransitionResult] | None:
        """The batch as one statement: every result if every row applied, else ``None``.

        The statement runs under a savepoint. When a row did not apply, the
        savepoint is rolled back (the rows it changed, and their locks, let go)
        and the caller decides the batch one row at a time in key order: a
        batch never holds one row while waiting for a row before it in key
        order, so two batches cannot deadlock.
        """
        with conn.begin_nested() as savepoint:
            applied = len(conn.execute(stmt, params).scalar_one() or ())
            if applied != len(params["a_k_id"]):
                savepoint.rollback()
                return None
        return [TransitionResult(TransitionStatus.APPLIED)] * applied

    @staticmethod
    def _fast_transition(request: Transition) -> bool:
        """Whether one statement can apply ``request`` (not one that rewrites the payload)."""
        return (
            request.args is None
            and request.kwargs is None
            and request.signature is None
            and bool(request.expect - TERMINAL)  # (a terminal state is never expected)
        )

    def _transition_one(
        self, conn: sa.Connection, ref: JobRef, request: Transition, *, brief: bool
    ) -> TransitionResult:
        """``transition`` in a transaction: one statement, else the locking decision."""
        if self._fast_transition(request):
            result = self._transition_fast(conn, ref, request, brief=brief)
            if result is not None:
                return result
        return self._transition(conn, ref, request)

    def _transition_fast(
        self, conn: sa.Connection, ref: JobRef, request: Transition, *, brief: bool
    ) -> TransitionResult | None:
        """The guarded ``UPDATE``; ``None`` when it changed nothing (the store decides again).

        Nothing changed means a guard failed, the lease is lost, there is no
        record, or a history the statement cannot extend: which one, and the
        record to answer with, the locking :meth:`_transition` tells.
        """
        stmt, params = self._sql.transition(self._namespace, ref, request, brief=brief)
        result = conn.execute(stmt, params)
        if self._postgresql:  # RETURNING: the record as written
            row = result.first()
            if row is None:
                return None
            return TransitionResult(TransitionStatus.APPLIED, None if brief else self._job(row))
        if result.rowcount != 1:
            return None
        if brief:
            return TransitionResult(TransitionStatus.APPLIED)
        # Read in the same transaction, under the row lock the update took: the record as written.
        job = self._select_job(conn, ref)
        if job is None:  # pragma: no cover - the row lock forbids this
            raise Rerun
        return TransitionResult(TransitionStatus.APPLIED, job)

    def _transition(
        self, conn: sa.Connection, ref: JobRef, request: Transition
    ) -> TransitionResult:
        """The locking transition: lock the row, decide in Python, write what it returns."""
        job = self._select_job(conn, ref, lock=True)
        if job is None:
            return TransitionResult(TransitionStatus.NOT_FOUND)
        now = self._now(conn)  # after the row lock: no writer of this job can follow
        lease = request.lease
        if lease is not None and not self._holds(conn, lease.name, lease.token, now):
            return TransitionResult(TransitionStatus.LEASE_LOST, job)
        at = times.from_micros(now)
        if not jobs.check_transition(job, request, at):
            return TransitionResult(TransitionStatus.CONFLICT, job)
        updated = jobs.apply_transition(job, request, at, self._compaction)
        c = self._t.jobs.c
        result = conn.execute(
            self._t.jobs.update()
            .where(self._pk(ref), c.rev == job.rev)
            .values(self._values(updated, key=False))
        )
        if result.rowcount != 1:  # belt and braces: the row lock forbids this
            raise Rerun
        return TransitionResult(TransitionStatus.APPLIED, updated)

    def _annotate_op(
        self, ref: JobRef, node: str, reason: str, op_id: str
    ) -> Callable[[sa.Connection], bool]:
        """The transaction of ``annotate`` (the note checked first)."""
        reason = jobs.check_note(node, reason, op_id)
        c = self._t.jobs.c

        def op(conn: sa.Connection) -> bool:
            job = self._select_job(conn, ref, lock=True)
            if job is None:
                return False
            at = times.from_micros(self._now(conn))
            noted = jobs.annotate_job(job, node=node, reason=reason, op_id=op_id, now=at)
            if noted is not job:
                history = self._values(noted, key=False)["history"]
                conn.execute(
                    self._t.jobs.update()
                    .where(self._pk(ref), c.rev == job.rev)
                    .values(history=history)
                )
            return True

        return op
