"""Prometheus: a real beat's ``/metrics`` and a real prefork worker's, scraped twice, moving.

Beat serves on ``exactonce_metrics_port``: its event counters, its last tick and
the store's counts (``exactonce_jobs{state=…}``). The worker (prefork, two
children) serves on ``exactonce_worker_metrics_port`` from its main process,
under ``PROMETHEUS_MULTIPROC_DIR``: the events its children counted (every
gated run's ``completed``: the main process runs no body, so any count there
came through the children's files) and the last reconcile pass
(``exactonce_reconcile_on = "worker"``). Each scrape is polled over HTTP with
a deadline until the next one shows every value moved.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.acceptance.harness import Deployment, poll
from tests.acceptance.scrapes import event, free_port, jobs, scrape_until, total


@pytest.mark.timeout(170)
@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis",))
def test_scrapes_of_beat_and_of_a_prefork_worker_show_counters_and_gauges_moving(
    deployment: Deployment, tmp_path: Path, gate: None
) -> None:
    beat_port = free_port()
    worker_port = poll(lambda: (port := free_port()) != beat_port and port)
    shared = {"exactonce_reconcile_on": "worker", "exactonce_reconcile_interval": 2}
    # Given a beat serving /metrics, ticking two gated entries every second
    beat = deployment.start_beat(
        every=1,
        entries=2,
        extra_env={
            "EXACTONCE_ACC_EXTRA_CONF": json.dumps(
                {
                    **shared,
                    "exactonce_metrics_port": beat_port,
                    "exactonce_metrics_addr": "127.0.0.1",
                }
            )
        },
    )
    # and a prefork worker serving /metrics in multiprocess mode (its own directory)
    multiproc = tmp_path / "prometheus-worker"
    multiproc.mkdir()
    deployment.extra_env = {
        "PROMETHEUS_MULTIPROC_DIR": str(multiproc),
        "EXACTONCE_ACC_EXTRA_CONF": json.dumps(
            {
                **shared,
                "exactonce_worker_metrics_port": worker_port,
                "exactonce_metrics_addr": "127.0.0.1",
            }
        ),
    }
    worker = deployment.start_worker(concurrency=2)
    assert worker.alive()

    # When both are scraped once things run, and again later
    completed, last_pass = (
        event("completed", state="SUCCEEDED"),
        (
            "exactonce_reconcile_last_pass_timestamp_seconds",
            (),
        ),
    )
    tick = ("exactonce_beat_last_tick_timestamp_seconds", (("node", beat.node),))
    first_beat = scrape_until(
        beat_port,
        lambda s: (
            s.get(event("dispatched"), 0) > 0
            and s.get(("exactonce_store_up", ()), 0) == 1
            and s.get(jobs("SUCCEEDED"), 0) > 0
            and tick in s
        ),
    )
    first_worker = scrape_until(
        worker_port, lambda s: s.get(completed, 0) > 0 and s.get(last_pass, 0) > 0
    )

    # Then beat's counters and gauges moved: dispatches, its tick, the store's counts
    second_beat = scrape_until(
        beat_port,
        lambda s: (
            s.get(event("dispatched"), 0) > first_beat[event("dispatched")]
            and s.get(tick, 0) > first_beat[tick]
            and s.get(jobs("SUCCEEDED"), 0) > first_beat[jobs("SUCCEEDED")]
        ),
    )
    assert total(second_beat, "exactonce_jobs") > total(first_beat, "exactonce_jobs")
    assert ("exactonce_due_jobs", ()) in second_beat
    assert ("exactonce_oldest_due_job_age_seconds", ()) in second_beat
    # and so did the worker's, counted in its pool's children and merged from their files
    second_worker = scrape_until(
        worker_port,
        lambda s: (
            s.get(completed, 0) > first_worker[completed]
            and s.get(last_pass, 0) > first_worker[last_pass]
        ),
    )
    assert second_worker[completed] > first_worker[completed] > 0
    assert len(list(multiproc.glob("counter_*.db"))) >= 2  # the children's own files


@pytest.mark.timeout(90)
@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("redis",))
def test_scenario_79_beat_and_a_worker_serve_metrics_with_only_a_port_set(
    deployment: Deployment, tmp_path: Path
) -> None:
    """SCENARIOS 79: a port and no address, as the how-to's first example writes it.

    Before the fix, the default address was ``""``, which prometheus-client
    refuses: beat and the worker each refused to start with "cannot serve
    /metrics on *:PORT: [Errno -2] Name or service not known".
    """
    beat_port = free_port()
    worker_port = poll(lambda: (port := free_port()) != beat_port and port)
    # Given a beat with exactonce_metrics_port only
    deployment.start_beat(
        extra_env={"EXACTONCE_ACC_EXTRA_CONF": json.dumps({"exactonce_metrics_port": beat_port})}
    )
    # and a worker with exactonce_worker_metrics_port only (a prefork pool: its directory)
    multiproc = tmp_path / "prometheus-worker"
    multiproc.mkdir()
    deployment.extra_env = {
        "PROMETHEUS_MULTIPROC_DIR": str(multiproc),
        "EXACTONCE_ACC_EXTRA_CONF": json.dumps({"exactonce_worker_metrics_port": worker_port}),
    }
    worker = deployment.start_worker(concurrency=1)

    # Then both serve /metrics, on every interface (scraped here on the loopback)
    beat_samples = scrape_until(beat_port, lambda s: ("exactonce_store_up", ()) in s)
    assert beat_samples[("exactonce_store_up", ())] in (0.0, 1.0)
    assert scrape_until(worker_port, lambda s: True) is not None
    assert worker.alive() and all(beat.alive() for beat in deployment.beats)
    listening = {f"0.0.0.0:{beat_port}", f"0.0.0.0:{worker_port}"}
    assert listening <= listening_sockets(), listening_sockets()


def listening_sockets() -> set[str]:
    """``ADDRESS:PORT`` of each IPv4 TCP socket listening on this host (``/proc/net/tcp``)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A":  # LISTEN
            address, port = local.split(":")
            octets = [str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0)]
            found.add(f"{'.'.join(octets)}:{int(port, 16)}")
    return found
