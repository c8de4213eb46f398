"""What the beat acceptance tests share: starting beats, waiting on the store's clock, slots.

A beat occurrence's run is identified in the ledger by the ``(entry, fire_time)``
its ``gated_beat`` / ``plain_beat`` body recorded from the message headers
(:meth:`harness.Ledger.occurrences`); the tests compare those runs with the
slots the schedule defines over a measured window.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta, timezone

from celery_exactonce import ExactOnceConfig
from celery_exactonce.beat.entries import occurrence_id
from celery_exactonce.core import keys
from celery_exactonce.core.jobs import Job
from celery_exactonce.core.refs import JobRef, epoch_born
from celery_exactonce.core.states import State
from tests.acceptance.harness import BeatProcess, Deployment, Ledger, poll

Occurrence = tuple[str, datetime]

#: How long the body runs of a window may trail its end (worker lag, queue drain).
DRAIN_TIMEOUT = 30.0

#: How far before its SIGKILL a beat's unfinished tick may have claimed slots.
TICK_SPAN = timedelta(seconds=2)


def entry_names(entries: int) -> list[str]:
    """The beat entries ``EXACTONCE_ACC_BEAT_ENTRIES=entries`` defines (``ledger_app``)."""
    return [f"beat-{index:02d}" for index in range(entries)]


def start_beats(
    deployment: Deployment,
    envs: Iterable[Mapping[str, str]],
    *,
    entries: int,
    every: float = 1.0,
) -> list[BeatProcess]:
    """One beat per environment in ``envs``, started together, then waited for."""
    beats = [
        deployment.start_beat(every=every, entries=entries, extra_env=env, wait=False)
        for env in envs
    ]
    for beat in beats:
        beat.wait_ready()
    return beats


def store_now(deployment: Deployment) -> datetime:
    now: datetime = deployment.store().now()
    return now


def run_until(deployment: Deployment, instant: datetime, beats: Iterable[BeatProcess]) -> None:
    """Poll the store's clock until ``instant``; fail at once if one of ``beats`` exits.

    The workload of a beat test is a fixed stretch of store time: this is how
    it waits for the end of a stretch, watching the beats meanwhile.
    """
    watched = list(beats)

    def reached() -> bool:
        for beat in watched:
            if not beat.alive():
                raise AssertionError(f"{beat!r} exited; log:\n{beat.log_tail()}")
        return bool(store_now(deployment) >= instant)

    timeout = max(0.0, (instant - store_now(deployment)).total_seconds()) + 10.0
    poll(reached, timeout=timeout, interval=0.1)


def claim_floor(deployment: Deployment) -> datetime:
    """No slot at or before this is claimed: the store epoch's birth plus ``max_skew``.

    Read after a beat has ticked (the first tick creates the epoch of a new namespace).
    """
    born = poll(lambda: epoch_born(deployment.store().epoch()), timeout=10)
    return born + timedelta(seconds=max_skew(deployment))


def max_skew(deployment: Deployment) -> float:
    return float(ExactOnceConfig.from_app(deployment.app()).max_skew)


def whole_second_after(instant: datetime) -> datetime:
    """The first whole second at or after ``instant`` (slots every second fall on them)."""
    stamp = math.ceil(instant.timestamp())
    return datetime.fromtimestamp(stamp, tz=timezone.utc)


def slots(entries: Iterable[str], start: datetime, end: datetime) -> set[Occurrence]:
    """Every ``(entry, fire_time)`` of every-second entries in ``[start, end]``."""
    fires = []
    fire = whole_second_after(start)
    while fire <= end:
        fires.append(fire)
        fire += timedelta(seconds=1)
    return {(entry, fire) for entry in entries for fire in fires}


def wait_executed(
    ledger: Ledger, expected: set[Occurrence], timeout: float = DRAIN_TIMEOUT
) -> None:
    """Poll until every occurrence of ``expected`` has a run in the ledger (or time out).

    Times out quietly: the assertions that follow say what is missing.
    """
    with contextlib.suppress(AssertionError):
        poll(lambda: expected <= set(ledger.occurrences()), timeout=timeout, interval=0.2)


def describe(deployment: Deployment, occurrences: Iterable[Occurrence], limit: int = 5) -> str:
    """The store's record of a few occurrences (state, node, dispatches), for failures."""
    lines = []
    for entry, fire in sorted(occurrences, key=lambda o: (o[1], o[0]))[:limit]:
        job = job_of(deployment, entry, fire)
        state = "absent" if job is None else f"{job.state.value} node={job.node} x{job.dispatches}"
        lines.append(f"  {entry} @ {fire.isoformat()}: {state}")
    return "\n".join(lines)


def job_of(deployment: Deployment, entry: str, fire: datetime) -> Job | None:
    ref = JobRef.occurrence(occurrence_id(deployment.namespace, entry, fire))
    job: Job | None = deployment.store().get(ref)
    return job


def unpublished_claims(
    deployment: Deployment, occurrences: Iterable[Occurrence], kills: Mapping[str, datetime]
) -> set[Occurrence]:
    """Those of ``occurrences`` a beat claimed and never published because it was SIGKILLed.

    ``kills`` maps the node of each beat a test SIGKILLed to the store time of
    the kill. An occurrence counts only if the store holds it under one of
    those nodes, ``SCHEDULED`` (claimed, never dispatched) or ``DISPATCHED``
    (killed between that write and the publish), with a fire time in the
    :data:`TICK_SPAN` before its kill: the tick the SIGKILL cut short. Such a
    job is the reconciler's to settle (replay, or time out), maybe only after
    the test has ended.
    """
    found = set()
    for entry, fire in occurrences:
        job = job_of(deployment, entry, fire)
        if job is None or job.node not in kills:
            continue
        if job.state not in (State.SCHEDULED, State.DISPATCHED):
            continue
        if kills[job.node] - TICK_SPAN <= fire <= kills[job.node]:
            found.add((entry, fire))
    return found


def assert_no_duplicates(ledger: Ledger) -> None:
    """No ``(entry, fire_time)`` ran twice, anywhere in the run."""
    twice = {occurrence: n for occurrence, n in ledger.occurrences().items() if n > 1}
    assert not twice, f"{len(twice)} occurrence(s) ran more than once: {sorted(twice.items())[:5]}"


def assert_each_ran_once(deployment: Deployment, ledger: Ledger, expected: set[Occurrence]) -> None:
    """Every occurrence of ``expected`` ran exactly once; none ran twice anywhere."""
    assert_no_duplicates(ledger)
    missing = expected - set(ledger.occurrences())
    assert not missing, (
        f"{len(missing)} of {len(expected)} occurrence(s) in the window never ran; "
        f"the store holds:\n{describe(deployment, missing)}"
    )


def assert_published_once(deployment: Deployment, expected: set[Occurrence]) -> None:
    """The store shows each occurrence published once, and each gated one ``SUCCEEDED``.

    Polls a little: the gate ends a job just after its body wrote the ledger.
    """
    running = sorted(expected)

    def ended() -> bool:
        left = []
        for entry, fire in running:
            job = job_of(deployment, entry, fire)
            assert job is not None and job.dispatches == 1, (entry, fire, job)
            if job.task == "gated_beat" and job.state is not State.SUCCEEDED:
                left.append((entry, fire))
        running[:] = left
        return not left

    try:
        poll(ended, timeout=10, interval=0.2)
    except AssertionError:
        raise AssertionError(
            f"{len(running)} gated occurrence(s) not SUCCEEDED:\n{describe(deployment, running)}"
        ) from None


def assert_keys_match(deployment: Deployment, ledger: Ledger) -> None:
    """Each run's task id and idempotency key are the ones its ``(entry, fire_time)`` derives."""
    for row in ledger.rows(phase="run"):
        occurrence = row.occurrence
        if occurrence is None:
            continue
        entry, fire = occurrence
        assert row.task_id == occurrence_id(deployment.namespace, entry, fire), row
        assert row.meta["idempotency_key"] == keys.idempotency_key(
            entry, fire, deployment.namespace
        ), row


def dispatched_by(beat: BeatProcess, after_real: float = 0.0) -> int:
    """How many occurrences ``beat`` published (its ``dispatched`` events) after a real time."""
    return sum(1 for event in beat.events("dispatched") if event["real"] >= after_real)


def claims_by(beat: BeatProcess, after_real: float = 0.0) -> int:
    """How many slot claims ``beat`` decided after a real time, won or found taken.

    A node racing several others may lose every slot for a while: this shows it
    kept claiming (its claims reached the store and were answered).
    """
    lost = sum(1 for event in beat.events("slot_already_claimed") if event["real"] >= after_real)
    return dispatched_by(beat, after_real) + lost


def skipped_slots(beats: list[BeatProcess], deployment: Deployment) -> dict[Occurrence, set[str]]:
    """Every slot some beat logged as skipped, or the store records so: slot -> reasons."""
    found: dict[Occurrence, set[str]] = {}
    ranges = [
        (event["entry"], event["first"], event["last"], event["where"])
        for beat in beats
        for event in beat.events("slot_skipped_entry")
    ]
    ranges += [
        (r.entry, r.first.isoformat(), r.last.isoformat(), r.where)
        for r in deployment.store().skipped(limit=10_000)
    ]
    for entry, first, last, where in ranges:
        start, end = datetime.fromisoformat(first), datetime.fromisoformat(last)
        for occurrence in slots([entry], start, end):
            found.setdefault(occurrence, set()).add(where)
    return found


def publishes(beats: list[BeatProcess]) -> Counter[str]:
    """Publishes per job id: every ``dispatched`` event of every beat (claims and replays)."""
    return Counter(str(event["job_id"]) for beat in beats for event in beat.events("dispatched"))
