"""The demo's processes: one ``celery`` process started in its own session, watched, stopped.

:class:`Child` starts ``celery -A celery_exactonce.demo.app`` with this
interpreter, its output in a log file of the work folder and its environment
naming the work folder and the node (so a source checkout run without an
install imports this same package); it tells whether the process is alive
(:class:`DemoError` with the end of its log if not), SIGTERMs it, and
SIGKILLs it with anything it started. :func:`poll` waits for a condition with
a deadline. :class:`DemoError` is what the demo raises when it cannot run.

Not here: which processes the demo starts, when it kills one and what it
measures (:mod:`~celery_exactonce.demo.run`), the app they run
(:mod:`~celery_exactonce.demo.app`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import site
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import celery_exactonce
from celery_exactonce.core import exceptions
from celery_exactonce.demo import app as demo_app

_T = TypeVar("_T")

STOP_TIMEOUT = 15.0
POLL_INTERVAL = 0.1


class DemoError(exceptions.ExactOnceError):
    """The demo could not run: a process did not start, or died."""


class Child:
    """One ``celery`` process of the demo, in its own session, its output in a log file."""

    def __init__(self, name: str, command: list[str], layout: demo_app.Layout) -> None:
        self.name = name
        self.log_path = layout.workdir / f"{name}.log"
        argv = [sys.executable, "-m", "celery", "-A", "celery_exactonce.demo.app", *command]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(  # noqa: S603 (argv: this interpreter, fixed words)
                argv,
                cwd=layout.workdir,
                env=_child_env(layout, name),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def check_alive(self) -> None:
        """Raise :class:`DemoError` with the end of the log if the process has exited."""
        if not self.alive():
            raise DemoError(
                f"{self.name} (pid {self.pid}) exited with status {self.process.returncode}; "
                f"the end of {self.log_path}:\n{self.log_tail()}"
            )

    def kill(self) -> None:
        """SIGKILL the process and anything it started; reap it. Safe to repeat."""
        if self.process.returncode is not None:
            return  # reaped: its pid (and group id) may belong to someone else by now
        if hasattr(os, "killpg"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        else:  # pragma: no cover - not POSIX
            self.process.kill()
        self.process.wait(timeout=STOP_TIMEOUT)

    def stop(self, timeout: float = STOP_TIMEOUT) -> bool:
        """SIGTERM, then SIGKILL after ``timeout`` s; whether it exited on the SIGTERM."""
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                return False
        return True


def _child_env(layout: demo_app.Layout, node: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            demo_app.ENV_WORKDIR: str(layout.workdir),
            demo_app.ENV_NODE: node,
            "PYTHONUNBUFFERED": "1",
        }
    )
    # A source checkout run without an install: the children (whose current
    # folder is the work folder) must import this same package.
    root = str(Path(celery_exactonce.__file__).resolve().parents[1])
    site_dirs = {*site.getsitepackages(), site.getusersitepackages()}
    if root not in site_dirs:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def poll(check: Callable[[], _T | None], timeout: float, what: str) -> _T:
    """Call ``check`` until it returns something truthy; :class:`DemoError` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise DemoError(f"{what}: not within {timeout:g} s")
        time.sleep(POLL_INTERVAL)
