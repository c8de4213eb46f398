"""``celery -A APP exactonce web`` as a real process on a spare port, polled until it answers.

:class:`WebProcess` starts the command in its own process group, its output
in a log file, and :meth:`WebProcess.wait_ready` polls the port with a
deadline (no sleep stands for a wait); :meth:`WebProcess.stop` ends the
group. The acceptance test of the dashboard and the command's tests use it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.support.helpers import poll

REPO_ROOT = Path(__file__).resolve().parents[2]
#: Seconds the command has to answer its first request (it imports the app, reads the store).
READY_TIMEOUT = 30.0


def spare_port() -> int:
    """A TCP port of 127.0.0.1 nothing listens on (just now)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class WebProcess:
    """``python -m celery -A app exactonce web --port P ARGS`` with ``env``, logging to a file."""

    def __init__(
        self, app: str, env: Mapping[str, str], log: Path, args: Sequence[str] = ()
    ) -> None:
        self.port = spare_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        pythonpath = [str(REPO_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
        self.env = {**env, "PYTHONPATH": os.pathsep.join(pythonpath), "PYTHONUNBUFFERED": "1"}
        self.argv = [
            sys.executable, "-m", "celery", "-A", app, "exactonce", "web",
            "--port", str(self.port), *args,
        ]  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> WebProcess:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return self

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def answers(self) -> bool:
        """Whether the server answers an HTTP request (any status) now."""
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"the dashboard exited ({self.process.returncode}):\n{self.log()}")
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2):  # noqa: S310 (http)
                return True
        except urllib.error.HTTPError:
            return True  # an answer (401 with auth)
        except OSError:
            return False

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> WebProcess:
        try:
            poll(self.answers, timeout=timeout, interval=0.1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the dashboard's log:\n{self.log()}") from None
        return self

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the process group, SIGKILL it past ``timeout``; the exit status."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout)
        return self.process.returncode
