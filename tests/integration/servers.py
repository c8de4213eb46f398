"""What the private test servers share: a free port, and a poll against a deadline.

Used by :mod:`tests.integration.redis_server` and :mod:`tests.integration.pg_servers`.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable


def free_port() -> int:
    """A TCP port of 127.0.0.1 free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(
    what: str,
    check: Callable[[], bool],
    timeout: float = 30.0,
    errors: tuple[type[BaseException], ...] = (OSError,),
) -> None:
    """Poll ``check`` until it holds, or fail naming ``what`` after ``timeout`` seconds.

    A check that raises one of ``errors`` (the server not answering yet) has not held.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except errors:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{what}: not within {timeout:g} s")
