"""``python chaos.py``: charge orders while workers are killed; was each charged once?

The run:

1. migrates the database (``PAYMENTS_DATABASE``), empties the example's
   tables, and makes ``--charges`` orders;
2. starts a ``celery worker`` (``-c --concurrency``) and a ``celery beat``
   (which runs the reconciler) on a namespace and a queue of its own;
3. submits a charge per order (``charges.charge.delay``);
4. every ``--kill-every`` seconds SIGKILLs a pool process of the worker in
   the middle of whatever body it runs, and every ``--restart-every``-th
   time the whole worker instead (its unacknowledged messages come back
   from the broker 10 s later), starting a new one: ``--kills`` in all;
5. waits until every order is charged, or nothing has changed for
   ``--quiet`` seconds; stops the processes and prints ``report.py``'s line.

Prints one JSON line (the variant, the kills, the seconds, the report) and
exits with ``report.py``'s status: 0 only if every order was charged exactly
once. ``PAYMENTS_VARIANT`` (``atomic``, ``gated``, ``plain``) picks how the
task runs (``charges/tasks.py``); the other two are the controls.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: Seconds a worker is left alone after it starts.
WARM_UP = 6.0


def _celery(*args: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(  # noqa: S603 (this interpreter, fixed arguments)
            [sys.executable, "-m", "celery", "-A", "charges", *args],
            cwd=HERE,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started (a prefork worker's pool)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(child) for child in text.split()]


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``process`` and everything it started (its session)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


class Run:
    """The worker and the beat of one chaos run, and what it did to them."""

    def __init__(self, args: argparse.Namespace, env: dict[str, str], logs: Path) -> None:
        self.args, self.env, self.logs = args, env, logs
        self.kills = self.restarts = 0
        self.worker = self._worker()
        self.beat = _celery(
            "beat",
            "--loglevel",
            "WARNING",
            "-s",
            str(logs / "beat"),
            env=env,
            log=logs / "beat.log",
        )

    def _worker(self) -> subprocess.Popen[bytes]:
        self.started = time.monotonic()
        name = f"{self.env['PAYMENTS_NAMESPACE']}-{self.restarts}@%h"
        return _celery(
            "worker", "-P", "prefork", "-c", str(self.args.concurrency), "-n", name,
            "--loglevel", "WARNING", env=self.env, log=self.logs / "worker.log",
        )  # fmt: skip

    def strike(self) -> bool:
        """Kill a pool process mid-body, or (every ``restart_every``-th time) the worker.

        Not while the worker starts (a pool process killed then stops it for good).
        """
        if time.monotonic() - self.started < WARM_UP:
            return False
        self.kills += 1
        if self.args.restart_every and self.kills % self.args.restart_every == 0:
            _kill_group(self.worker)
            self.restarts += 1
            self.worker = self._worker()
            return True
        pool = _children(self.worker.pid)
        if pool:
            os.kill(random.choice(pool), signal.SIGKILL)  # noqa: S311 (not crypto)
        return True

    def stop(self) -> None:
        for process in (self.worker, self.beat):
            _kill_group(process)


def _charged() -> tuple[int, int]:
    """Orders charged at least once, and charges in all."""
    from charges.models import Charge, Order

    return Order.objects.filter(charges__isnull=False).distinct().count(), Charge.objects.count()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--charges", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--kill-every", type=float, default=2.0, help="seconds between kills")
    parser.add_argument("--restart-every", type=int, default=4, help="every n-th kill: all")
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--quiet", type=float, default=40.0, help="seconds with no change: done")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()

    namespace = f"payments-{uuid.uuid4().hex[:8]}"  # the store's, and the queue
    os.environ["PAYMENTS_NAMESPACE"] = namespace
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "charges.settings")
    sys.path.insert(0, str(HERE))
    import django
    from django.core.management import call_command

    django.setup()
    import report
    from charges.celery import app
    from charges.models import Order
    from charges.tasks import charge_task
    from django.conf import settings

    call_command("migrate", verbosity=0)
    Order.objects.all().delete()
    orders = Order.objects.bulk_create(Order(cents=1000 + n) for n in range(args.charges))
    logs = Path(tempfile.mkdtemp(prefix="payments-chaos-"))
    run = Run(args, {**os.environ, "PYTHONPATH": str(HERE)}, logs)
    started = time.monotonic()
    try:
        for order in orders:
            charge_task.delay(order.id)
        last, changed, next_kill = (-1, -1), time.monotonic(), started + args.kill_every
        while time.monotonic() - started < args.timeout:
            now = time.monotonic()
            seen = _charged()
            if seen != last:
                last, changed = seen, now
            if (seen[0] == args.charges and now - changed > 5) or now - changed > args.quiet:
                break  # all charged (and settled a little), or nothing moves any more
            if run.kills < args.kills and now >= next_kill and run.strike():
                next_kill = now + args.kill_every
            time.sleep(0.2)
    finally:
        run.stop()
        app.close()
    found = report.summary()
    print(
        json.dumps(
            {
                "variant": settings.VARIANT,
                "charges": args.charges,
                "kills": run.kills,
                "worker_restarts": run.restarts,
                "seconds": round(time.monotonic() - started, 1),
                "logs": str(logs),
                "report": found,
            }
        )
    )
    return 1 if found["charged_twice"] or found["missing"] else 0


if __name__ == "__main__":
    sys.exit(main())
