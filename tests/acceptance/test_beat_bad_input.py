"""Real ``celery beat -S exactonce`` processes given bad entries, and kombu-typed arguments.

SCENARIOS 70: a beat started with one bad entry (an argument JSON cannot hold,
an over-long or control-character name, an option that collides with
``send_task``) refuses to start, naming the entry, before it claims anything;
the beat nodes already running keep running their entries, and nothing stored
is touched. Arguments that kombu's JSON serializer carries (``datetime``,
``Decimal``, ``UUID``, ``bytes``) are no bad entry: the body receives exactly
what plain Celery delivers for them.
"""

from __future__ import annotations

import pytest

from tests.acceptance.apps.ledger_app import BAD_ENTRY_NAMES, TYPED_ARGS
from tests.acceptance.harness import Deployment, Ledger, poll

#: How long a refused beat may take to exit (imports, store connection, then the check).
EXIT_TIMEOUT = 30.0


@pytest.mark.timeout(120)
@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis",))
def test_a_beat_with_a_bad_entry_refuses_to_start_naming_it_and_others_keep_running(
    deployment: Deployment, ledger: Ledger, gate: None
) -> None:
    """SCENARIOS 70.

    Fails before the fix: each such beat started ("beat: Starting..."), then died
    at the bad entry's first due slot (the argument, the names), or published it
    as an "ambiguous" failure forever (``retry``). Before the later fix, an entry
    Celery itself cannot read (an unknown field, a schedule written as text)
    ended beat on Celery's raw ``TypeError``/``AttributeError`` traceback,
    naming no entry.
    """
    # Given a worker and a beat running the two ordinary entries
    deployment.start_worker(concurrency=2)
    good = deployment.start_beat(every=1)
    ledger.wait_count(2, task="gated_record")
    # When beats are started, each with one bad entry besides the ordinary ones
    refused = {
        kind: deployment.start_beat(
            every=1, extra_env={"EXACTONCE_ACC_BEAT_EXTRA": kind}, wait=False
        )
        for kind in BAD_ENTRY_NAMES
    }
    # Then each exits with an error naming its entry, before it started beating
    for kind, beat in refused.items():
        poll(lambda beat=beat: not beat.alive(), timeout=EXIT_TIMEOUT, interval=0.1)  # type: ignore[misc]
        assert beat.proc is not None and beat.proc.returncode != 0, beat.log_tail()
        log = beat.log()
        (line,) = [
            line for line in log.splitlines() if "celery-exactonce: beat refused to start" in line
        ]
        assert f"beat entry {BAD_ENTRY_NAMES[kind]!r}"[:40] in line
        assert not beat.events("dispatched") and "Scheduler: Sending" not in log
    # And the running beat went on with its entries; nothing of the bad ones ran
    seen = ledger.count(task="gated_record")
    ledger.wait_count(seen + 2, task="gated_record")
    assert good.alive()
    assert all(row.args == ["beat"] for row in ledger.rows(task="plain_record"))


@pytest.mark.timeout(120)
@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis", "postgres"))
def test_kombu_typed_beat_arguments_reach_the_body_as_plain_celery_sends_them(
    deployment: Deployment, ledger: Ledger, gate: None
) -> None:
    """SCENARIOS 70: a ``datetime``/``Decimal``/``UUID``/``bytes`` argument is no bad entry.

    Fails before the fix: beat died at the entry's first due slot (the claim's
    payload "cannot be stored as JSON"), on every node.
    """
    # Given a worker, and a beat whose entries pass kombu-typed arguments to a gated
    # and to a plain task
    deployment.start_worker(concurrency=2)
    beat = deployment.start_beat(every=1, extra_env={"EXACTONCE_ACC_BEAT_EXTRA": "typed"})
    # When the same call goes through plain Celery
    kwargs = {"when": TYPED_ARGS[0], "amount": TYPED_ARGS[2]}
    plain = deployment.app().send_task(
        "plain_record", args=("plain-celery", *TYPED_ARGS), kwargs=kwargs
    )
    # Then the bodies beat's occurrences ran got exactly what plain Celery delivered
    (sent,) = ledger.wait_count(1, task_id=plain.id)
    for kind in ("gated", "plain"):

        def ran(kind: str = kind) -> list[object] | None:
            rows = [r for r in ledger.rows(task=f"{kind}_record") if r.args[0] == f"typed-{kind}"]
            return rows or None

        rows = poll(ran, timeout=30)
        for row in rows:
            assert row.args[1:] == sent.args[1:] and row.kwargs == sent.kwargs  # type: ignore[attr-defined]
    assert sent.args[1].startswith("datetime.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=")
    assert sent.args[3:5] == ["Decimal('19.990')", f"{TYPED_ARGS[3]!r}"]
    assert beat.alive(), beat.log_tail()
