"""Submit delayed payments, or run one's charge a second time.

``python submit.py --orders 3 --countdown 10``
    submits a charge for each of 3 new orders, due in 10 seconds
    (``apply_async(countdown=10)``): the jobs wait in the store until a beat
    node dispatches them. Prints ``{"submitted": [{"order", "cents",
    "task_id"}, ...]}``.

``python submit.py --again <task id>``
    runs that job's charge body once more, here, with the idempotency key the
    worker had (what a re-run after a crash, or any second run of the body,
    would do): the provider refuses the second charge. Prints ``{"task_id",
    "order", "charged"}``.

``python submit.py --redeliver <task id>``
    publishes that job's message once more, as a broker that redelivers
    would (a lost ack, a visibility timeout): the worker's gate drops it, the
    body does not run. Prints ``{"task_id", "order", "redelivered": true}``.
"""

from __future__ import annotations

import argparse
import json
import uuid

from payments import app, charge

from celery_exactonce import Job, JobRef, store_from_url


def submit(orders: int, countdown: float) -> None:
    submitted = []
    for n in range(orders):
        order, cents = f"order-{uuid.uuid4().hex[:8]}", 1000 + n
        job = charge.apply_async(args=[order, cents], countdown=countdown)
        submitted.append({"order": order, "cents": cents, "task_id": job.id})
    print(json.dumps({"submitted": submitted}))


def stored(task_id: str) -> Job:
    """The job ``task_id`` as the store holds it (its args are the charge's)."""
    store = store_from_url(app.conf.exactonce_store_url, namespace=app.conf.exactonce_namespace)
    try:
        job = store.get(JobRef.submitted(task_id))
    finally:
        store.close()
    if job is None:
        raise SystemExit(f"no job {task_id} in the store")
    return job


def again(task_id: str) -> None:
    job = stored(task_id)
    # apply(): the body runs in this process, outside the gate, with the job's key.
    charged = charge.apply(args=job.args, kwargs=job.kwargs, task_id=task_id).get()
    print(json.dumps({"task_id": task_id, "order": job.args[0], "charged": charged}))


def redeliver(task_id: str) -> None:
    job = stored(task_id)
    # send_task publishes a bare copy of the message, with the job's id: not a new job
    # (apply_async with that id would return the job that exists), a second delivery.
    app.send_task(charge.name, args=job.args, kwargs=job.kwargs, task_id=task_id)
    print(json.dumps({"task_id": task_id, "order": job.args[0], "redelivered": True}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--orders", type=int, help="how many new orders to charge")
    group.add_argument("--again", metavar="TASK_ID", help="run this job's charge once more")
    group.add_argument("--redeliver", metavar="TASK_ID", help="publish this job's message again")
    parser.add_argument("--countdown", type=float, default=10.0, help="seconds until due")
    options = parser.parse_args()
    if options.again:
        again(options.again)
    elif options.redeliver:
        redeliver(options.redeliver)
    else:
        submit(options.orders, options.countdown)


if __name__ == "__main__":
    main()
