"""Secrets stay secret and signed payloads hold, in real ``celery worker`` and ``celery beat``.

Issue 11, holes 17 and 18, end to end:

* the store URL carries its password in the query (``?password=``: PostgreSQL's
  trust authentication and this Redis ignore it, so the deployment works) and
  the app sets a rotating ``exactonce_signing_key``; after a run of beat slots,
  signed submits and retries (re-signed with new kwargs), the whole output of
  every process (logs, beat banner, event records) is grepped for the secrets;
* a delayed job whose args are changed in the store before it is due is
  refused by beat's sweep: ``FAILED`` (signature invalid), counted, never run.

Fails on the code before the fix: the banner printed ``?password=`` in clear,
and the tampered job ran with the changed args.
"""

from __future__ import annotations

import json

import pytest

from celery_exactonce.core.refs import JobRef
from celery_exactonce.core.states import State
from tests.acceptance.harness import Deployment, Ledger
from tests.support.helpers import poll, tamper

STORE_SECRET = "St0reS3cretInQuery"
SIGNING_KEYS = ["NewS1gningKey-0123456789", "OldS1gningKey-9876543210"]


@pytest.mark.timeout(150)
@pytest.mark.acceptance_matrix(brokers=("redis",), stores=("postgres", "redis"))
def test_no_secret_in_any_output_and_a_tampered_job_never_runs(
    deployment: Deployment, ledger: Ledger, gate: None
) -> None:
    # Given a deployment whose store URL holds a password in its query, signing on
    deployment.store_url += f"{'&' if '?' in deployment.store_url else '?'}password={STORE_SECRET}"
    deployment.extra_env["EXACTONCE_ACC_EXTRA_CONF"] = json.dumps(
        {"exactonce_signing_key": SIGNING_KEYS}
    )
    worker = deployment.start_worker(concurrency=2)
    beat = deployment.start_beat(every=1, entries=2)

    # When beat runs its slots, jobs are submitted and retried with new kwargs...
    retried = deployment.send("gated_retry", 2, 0)  # retries published by the worker
    delayed_retry = deployment.send("gated_retry", 1, 1)  # retry swept by beat
    plain = deployment.send("gated_record", "hello")
    # ... and a delayed job's args are changed in the store before it is due
    victim = deployment.send("gated_record", "harmless", countdown=4)
    ref = JobRef.submitted(victim.id)
    poll(lambda: deployment.job(victim.id) is not None)
    tamper(deployment.store(), ref, "args", ["evil"])

    # Then the signed jobs ran (retries re-signed), beat's slots ran...
    ledger.wait_count(3, task="gated_retry", task_id=retried.id)
    ledger.wait_count(2, task="gated_retry", task_id=delayed_retry.id)
    ledger.wait_count(1, task="gated_record", task_id=plain.id)
    ledger.wait_count(2, task="gated_beat")
    # ... and the tampered one was refused at its sweep: FAILED, counted, never run
    poll(lambda: deployment.job_state(victim.id) is State.FAILED, timeout=30)
    assert deployment.record(victim.id).reason.startswith("signature invalid")
    poll(lambda: beat.events("signature_invalid"), timeout=10)
    assert ledger.count(task_id=victim.id) == 0
    for job_id in (retried.id, delayed_retry.id, plain.id):
        poll(lambda job_id=job_id: deployment.job_state(job_id) is State.SUCCEEDED)

    # And no process printed a secret anywhere (banner, logs, errors, event records)
    beat.kill()
    worker.kill()
    outputs = {
        "beat log": beat.log(),
        "beat events": beat.events_path.read_text(errors="replace"),
        "worker log": worker.log(),
    }
    assert "store -> " in outputs["beat log"]  # the banner is there, redacted
    assert "password=***" in outputs["beat log"]
    for name, text in outputs.items():
        for secret in (STORE_SECRET, *SIGNING_KEYS):
            assert secret not in text, f"{secret!r} found in the {name}"
