"""Liveness and readiness: what beat's and a worker's ``/healthz`` and ``/readyz`` answer.

Served beside ``/metrics`` on the same port (``exactonce_metrics_port`` for
beat, ``exactonce_worker_metrics_port`` for a worker), for a Kubernetes
``httpGet`` probe; ``celery -A APP exactonce probe beat|worker`` asks the same
from a shell, for an ``exec`` probe or a container's ``HEALTHCHECK``.

* **beat is live** while it ticks: its last tick ended, or the tick it is in
  began, less than :func:`stall_after` seconds ago (before its first tick:
  since it started). A beat that fails that is stuck: restart it.
* **beat is ready** when its last tick reached the store, and no store call
  failed during it. One that cannot claims nothing (it fails closed) and
  says why; restarting it would not bring the store back, so that is
  readiness, not liveness. Times are on the monotonic clock: a step of the
  wall clock neither fails nor hides a stall.
* **a worker is live** while its main process answers and it has not begun
  to stop.
* **a worker is ready** when its consumer is connected to the broker and the
  store answered within :data:`STORE_WAIT` seconds (asked at most every
  :data:`STORE_MAX_AGE` seconds, by one thread of its own: a Django store
  opens one connection per thread).

Not here: the HTTP server (:mod:`celery_exactonce.observe.prometheus`), the
probe command (:mod:`celery_exactonce.cli.probe`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from celery_exactonce.observe.gauges import BeatGauges, one_line

#: Beat is stuck when no tick ended (and none began) for this many tick intervals...
STALL_TICKS = 10
#: ...or this many seconds, whichever is longer (a tick of many due entries takes a while).
STALL_FLOOR = 60.0
#: Seconds a worker's readiness serves the store's last answer before it asks again.
STORE_MAX_AGE = 5.0
#: Seconds a worker's readiness waits for the store to answer.
STORE_WAIT = 3.0

#: The paths, each answered ``200`` (the check holds) or ``503`` (it does not).
LIVE_PATH = "/healthz"
READY_PATH = "/readyz"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A probe's answer: whether the check holds, and why, in one line."""

    ok: bool
    why: str

    def text(self) -> str:
        """The line served and printed: ``ok: …`` or ``failing: …``."""
        return f"{'ok' if self.ok else 'failing'}: {self.why}"


class Probes(Protocol):
    """What a process answers to its liveness and readiness probes."""

    def live(self) -> Verdict: ...

    def ready(self) -> Verdict: ...


def stall_after(tick_interval: float) -> float:
    """Seconds without a tick after which beat counts as stuck."""
    return max(STALL_FLOOR, STALL_TICKS * tick_interval)


class BeatProbes:
    """Beat's answers, from its :class:`~celery_exactonce.observe.gauges.BeatGauges`."""

    def __init__(self, gauges: BeatGauges, tick_interval: float) -> None:
        self.gauges = gauges
        self.stall = stall_after(tick_interval)

    def live(self) -> Verdict:
        what, since = self.gauges.since_tick()
        text = f"{what} {since:.1f} s ago (stuck after {self.stall:g} s)"
        return Verdict(since < self.stall, text)

    def ready(self) -> Verdict:
        reached, error = self.gauges.store_reached, self.gauges.store_error
        if reached is None:
            return Verdict(False, "no tick has reached the store yet")
        if not reached:
            return Verdict(False, f"the last tick could not reach the store: {error}")
        return Verdict(True, "the last tick reached the store")


class WorkerProbes:
    """A worker's answers, from its ``WorkController`` and the app's store."""

    def __init__(
        self,
        worker: Any,
        store_now: Callable[[], object],
        *,
        max_age: float = STORE_MAX_AGE,
        wait: float = STORE_WAIT,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.worker = worker
        self._store_now = store_now
        self.max_age, self.wait = max_age, wait
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._asker = concurrent.futures.ThreadPoolExecutor(1, "exactonce-readyz")
        self._asked: tuple[float, concurrent.futures.Future[object]] | None = None

    def live(self) -> Verdict:
        state = _state(self.worker)
        if state is not None and state > _RUN:
            return Verdict(False, "the worker is stopping")
        return Verdict(True, "the worker's main process answers")

    def ready(self) -> Verdict:
        live = self.live()
        if not live.ok:
            return live
        broker = _consumer_problem(getattr(self.worker, "consumer", None))
        if broker is not None:
            return Verdict(False, broker)
        try:
            self._answer().result(self.wait)
        except concurrent.futures.TimeoutError:
            return Verdict(False, f"the store did not answer within {self.wait:g} s")
        except Exception as exc:  # the store's errors name the store, secrets blanked
            why = one_line(exc) or type(exc).__name__
            return Verdict(False, f"the store did not answer: {why}")
        return Verdict(True, "connected to the broker; the store answers")

    def _answer(self) -> concurrent.futures.Future[object]:
        """The store's answer, asked again once older than ``max_age``, or once it failed."""
        now = self._monotonic()
        with self._lock:
            asked = self._asked
            if asked is not None:
                at, future = asked
                failed = future.done() and future.exception() is not None
                if not failed and (now - at < self.max_age or not future.done()):
                    return future
            future = self._asker.submit(self._store_now)
            self._asked = (now, future)
            return future

    def close(self) -> None:
        self._asker.shutdown(wait=False)


#: celery.bootsteps' states: RUN, then CLOSE and TERMINATE as the worker stops.
_RUN = 1


def _state(worker: Any) -> int | None:
    blueprint = getattr(worker, "blueprint", None)
    state = getattr(blueprint, "state", None)
    return state if isinstance(state, int) else None


def _consumer_problem(consumer: Any) -> str | None:
    """Why the worker's consumer is not taking messages (``None``: it is connected)."""
    if consumer is None:
        return "the worker's consumer has not started"
    if _state(consumer) != _RUN:
        return "the worker's consumer is not running (starting, or reconnecting to the broker)"
    connection = getattr(consumer, "connection", None)
    if connection is None or not connection.connected:
        return "the worker is not connected to the broker"
    return None


TEXT = "text/plain; charset=utf-8"
StartResponse = Callable[[str, list[tuple[str, str]]], Any]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


def with_probes(metrics_app: WSGIApp, probes: Probes | None) -> WSGIApp:
    """``metrics_app``, with :data:`LIVE_PATH` and :data:`READY_PATH` answered by ``probes``."""
    if probes is None:
        return metrics_app

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path not in (LIVE_PATH, READY_PATH):
            return metrics_app(environ, start_response)
        verdict = probes.live() if path == LIVE_PATH else probes.ready()
        body = (verdict.text() + "\n").encode()
        status = "200 OK" if verdict.ok else "503 Service Unavailable"
        length = str(len(body))
        start_response(status, [("Content-Type", TEXT), ("Content-Length", length)])
        return [body]

    return app
