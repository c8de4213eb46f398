"""A private, throw-away redis-server for tests that restart or misconfigure Redis.

The shared Redis of the machine is never restarted by a test: these tests
start their own server on a free port, with no persistence, and stop it.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    def __init__(self, *extra: str) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.skip("redis-server is not installed")
        self.port = _free_port()
        self.extra = extra
        self.dir = tempfile.mkdtemp(prefix="exactonce-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert self.binary is not None
        self.process = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), 0.2) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"redis-server on port {self.port} did not start")

    def kill(self) -> None:
        """SIGKILL: whatever was in memory is gone (no persistence)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=15)
            self.process = None


@contextmanager
def redis_server(*extra: str) -> Iterator[RedisServer]:
    server = RedisServer(*extra)
    server.start()
    try:
        yield server
    finally:
        server.kill()
        shutil.rmtree(server.dir, ignore_errors=True)
