"""A writer held half-way through a publish, and a reader, on the demo's broker (real processes).

``python -m tests.acceptance.apps.demo_broker put WORKDIR`` publishes one
``demo.record`` message with the demo app of ``WORKDIR``
(:func:`celery_exactonce.demo.app.make_app`), and holds at the last step
before the message is complete: for kombu's ``filesystem`` transport, once the
message file exists and before its bytes are written; for the ``sqlalchemy``
transport, once the row is inserted and before the commit. At the hold it
creates ``WORKDIR/held`` and waits (up to :data:`HOLD_LIMIT` s) for
``WORKDIR/release``; it prints ``{"task_id": ...}`` when the publish returns.

``python -m tests.acceptance.apps.demo_broker get WORKDIR`` creates
``WORKDIR/reading``, takes one message from the demo's queue the way a worker
does (``basic_get``) and prints what it got: ``{"outcome": "message",
"task_id": ...}``, ``{"outcome": "empty"}`` or ``{"outcome": "error",
"error": ...}``.

The hold is a fault point: nothing here replaces the broker.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from celery_exactonce.demo import app as demo_app

HELD = "held"
RELEASE = "release"
READING = "reading"
#: A writer left held this long gives up (exit 3): a test that forgot it must not hang.
HOLD_LIMIT = 120.0


def _hold(workdir: Path) -> None:
    (workdir / HELD).touch()
    deadline = time.monotonic() + HOLD_LIMIT
    while not (workdir / RELEASE).exists():
        if time.monotonic() > deadline:
            print(f"held over {HOLD_LIMIT} s without a release", file=sys.stderr)
            sys.exit(3)
        time.sleep(0.02)


def _install_hold(workdir: Path, broker_url: str) -> None:
    """Hold the first message publish at its last step, whatever the demo's transport."""
    if broker_url.startswith("filesystem:"):
        from kombu.transport import filesystem

        real_lock = filesystem.lock

        def lock(file: Any, flags: int) -> None:
            # _put: open (the file is in the queue folder now, empty), lock, write.
            real_lock(file, flags)
            if str(getattr(file, "name", "")).endswith(".msg"):
                _hold(workdir)

        filesystem.lock = lock
    elif broker_url.startswith(("sqla+", "sqlalchemy+")):
        from sqlalchemy import event
        from sqlalchemy.orm import Session

        def after_flush(session: Session, _context: object) -> None:
            # _put: the INSERT has run in the session's transaction; COMMIT has not.
            if any(type(obj).__name__ == "Message" for obj in session.new):
                _hold(workdir)

        event.listen(Session, "after_flush", after_flush)
    else:
        raise SystemExit(f"no hold point for the broker {broker_url!r}")


def put(workdir: Path) -> None:
    app = demo_app.make_app(demo_app.Layout(workdir), node="writer")
    _install_hold(workdir, str(app.conf.broker_url))
    result = app.send_task(demo_app.TASK, args=("held",), queue=demo_app.QUEUE)
    print(json.dumps({"task_id": result.id}))


def get(workdir: Path) -> None:
    app = demo_app.make_app(demo_app.Layout(workdir), node="reader")
    with app.connection_for_read() as conn:
        channel = conn.default_channel
        (workdir / READING).touch()
        try:
            message = channel.basic_get(demo_app.QUEUE, no_ack=True)
        except Exception as exc:  # reported: the test judges it
            print(json.dumps({"outcome": "error", "error": f"{type(exc).__name__}: {exc}"}))
            return
    if message is None:
        print(json.dumps({"outcome": "empty"}))
    else:
        print(json.dumps({"outcome": "message", "task_id": message.headers.get("id")}))


def main(argv: list[str]) -> None:
    command, workdir = argv
    {"put": put, "get": get}[command](Path(workdir))


if __name__ == "__main__":
    main(sys.argv[1:])
