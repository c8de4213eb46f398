"""What beat holds back while it ticks: SIGTERM, and the cyclic garbage collector.

SIGTERM: Celery's own handler raises ``SystemExit`` wherever beat is, which
could cut a tick between a claim and its dispatch (the reconciler would
settle it, late). :class:`HeldSigterm` replaces it: outside a tick, beat exits
at once; inside one, the signal is noted and the tick ends first
(:meth:`HeldSigterm.ticking`).

The collector (:func:`collector_held`): a tick of many due entries makes
objects by the hundred thousand (a job per slot, its record, its message),
and each of Python's collections along the way scans every object beat
holds: a fifth of a 10,000-entry tick went to them. Nearly all of a tick's
objects are freed by their reference counts as it goes; the collector runs
after the tick on what is left (cycles a tick made wait for it, no longer).
"""

from __future__ import annotations

import gc
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery_exactonce.observe import metrics


class HeldSigterm:
    """Whether beat is in a tick, and whether a SIGTERM came during one."""

    def __init__(self) -> None:
        self.in_tick = False
        self.requested = False

    def install(self) -> None:
        """Replace Celery's SIGTERM handler (in the main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            return  # embedded (beat -B in a worker thread): the host owns the signals

        def on_sigterm(_signum: int, _frame: Any) -> None:
            if self.in_tick:
                # Finish the tick first. Nothing else here: a counter's lock may be held
                # by the code this handler interrupted (reported when the tick ends).
                self.requested = True
            else:
                raise SystemExit(0)

        signal.signal(signal.SIGTERM, on_sigterm)

    @contextmanager
    def ticking(self) -> Iterator[None]:
        """A tick: a SIGTERM that arrives in it ends beat when it ends."""
        self.in_tick = True
        try:
            yield
        finally:
            self.in_tick = False
            if self.requested:
                metrics.event(
                    "beat_stopping",
                    "SIGTERM arrived during a tick: its claims are dispatched, beat stops",
                )
                raise SystemExit(0)


@contextmanager
def collector_held() -> Iterator[None]:
    """The cyclic garbage collector off for the block, unless someone else turned it off."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
