"""Fault points of a real beat process: it SIGKILLs itself at a named point of its work.

``ledger_app`` calls :func:`install_kill_points` at import; with the variables
unset it does nothing. Set them on one beat process only
(``Deployment.start_beat(extra_env=...)``):

``EXACTONCE_ACC_KILL_AT=after_claim``
    right after the delayed-job sweep's ``claim_due`` returned a non-empty
    batch, before any ``DISPATCHED`` write: the batch stays ``SCHEDULED``
    (scenarios B7, F32).
``EXACTONCE_ACC_KILL_AT=after_dispatched_write``
    right after a ``DISPATCHED`` write of one dispatch chunk applied for at
    least one job, before any of its publishes: the chunk stays ``DISPATCHED``
    with no message (scenario B8).
``EXACTONCE_ACC_KILL_REASON``
    for ``after_dispatched_write``: the dispatch reason whose write kills
    (default ``sweep``: the delayed-job sweep; ``beat``: beat's slot claims).
    Writes with another reason (a reconciler replay) go on untouched.
``EXACTONCE_ACC_SWEEP=off``
    the delayed-job sweep claims nothing (``claim_due`` answers ``[]`` without
    touching the store): a beat that only runs its slots and its reconciler,
    started before a drill, takes none of the jobs a dying beat is to claim.

Before dying the process writes one line to stderr (its log),
``exactonce-acc kill: <point>: <n> job(s): <ref> <ref> ...``, so a test can
check that it died there and which jobs it left behind (:func:`killed_jobs`).
"""

from __future__ import annotations

import functools
import os
import signal
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

#: The line a process writes to stderr just before it SIGKILLs itself.
KILL_MARK = "exactonce-acc kill:"
KILL_POINTS = ("after_claim", "after_dispatched_write")


def install_kill_points(env: Mapping[str, str]) -> None:
    """Wrap the product's methods in this process as the variables say (module docs)."""
    if (env.get("EXACTONCE_ACC_SWEEP") or "").strip() == "off":
        _sweep_off()
    point = (env.get("EXACTONCE_ACC_KILL_AT") or "").strip()
    if not point:
        return
    if point not in KILL_POINTS:
        raise ValueError(f"EXACTONCE_ACC_KILL_AT={point!r}: expected one of {KILL_POINTS}")
    if point == "after_claim":
        _kill_after_claim()
    else:
        _kill_after_dispatched_write(env.get("EXACTONCE_ACC_KILL_REASON") or "sweep")


def _die(point: str, refs: Iterable[object]) -> None:
    listed = [str(ref) for ref in refs]
    sys.stderr.write(f"{KILL_MARK} {point}: {len(listed)} job(s): {' '.join(listed)}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


ClaimDue = Callable[..., list[Any]]


def _wrap_claim_due(wrap: Callable[[ClaimDue], ClaimDue]) -> None:
    """``store.claim_due = wrap(store.claim_due)`` on every store this process opens."""
    from celery_exactonce import runtime

    open_store = runtime.open_store

    @functools.wraps(open_store)
    def open_and_wrap(*args: Any, **kwargs: Any) -> Any:
        store = open_store(*args, **kwargs)
        store.claim_due = functools.wraps(store.claim_due)(wrap(store.claim_due))
        return store

    runtime.open_store = open_and_wrap  # what Runtime() calls to open its store


def _sweep_off() -> None:
    """``claim_due`` claims nothing."""

    def off(_claim_due: ClaimDue) -> ClaimDue:
        def claim_nothing(*_args: Any, **_kwargs: Any) -> list[Any]:
            return []

        return claim_nothing

    _wrap_claim_due(off)


def _kill_after_claim() -> None:
    """Die after a ``claim_due`` that claimed something."""

    def arm(claim_due: ClaimDue) -> ClaimDue:
        def claim_then_die(*args: Any, **kwargs: Any) -> list[Any]:
            claimed = claim_due(*args, **kwargs)
            if claimed:
                _die("after_claim", (job.ref for job in claimed))
            return claimed

        return claim_then_die

    _wrap_claim_due(arm)


def _kill_after_dispatched_write(reason: str) -> None:
    """``Dispatcher._write_dispatched`` dies once a write of ``reason`` applied."""
    from celery_exactonce.dispatch.dispatcher import Dispatcher
    from celery_exactonce.dispatch.outcomes import DispatchResult

    write_dispatched = Dispatcher._write_dispatched

    @functools.wraps(write_dispatched)
    def write_then_die(self: Dispatcher, writes: Any) -> Any:
        out = write_dispatched(self, writes)
        if any(request.reason == reason for _, _, request in writes):
            written = [job.ref for _, job in out if not isinstance(job, DispatchResult)]
            if written:
                _die("after_dispatched_write", written)
        return out

    Dispatcher._write_dispatched = write_then_die  # type: ignore[method-assign]


def killed_jobs(log: str, point: str) -> list[str] | None:
    """The job refs (``t:<id>``) a process's :data:`KILL_MARK` line for ``point`` names.

    ``None`` if the log has no such line (the process did not die there).
    """
    mark = f"{KILL_MARK} {point}: "
    for line in log.splitlines():  # Celery's log redirection may prefix the line
        _, found, rest = line.partition(mark)
        if found:
            return rest.split(": ", 1)[1].split()
    return None
