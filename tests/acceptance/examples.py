"""What the tests of ``examples/`` share: an example copied and run from its own folder.

Each test copies its example to a temporary folder (its files, databases and
ledgers are made there), gives it Redis databases of its own, and runs its
``celery`` processes and its scripts from that folder as its README says.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests import services
from tests.acceptance.harness import REPO_ROOT, CeleryProcess


class ExampleProcess(CeleryProcess):
    """``celery -A <app_module> <args>`` from an example's folder, its output in ``log_path``."""

    def __init__(
        self, app_module: str, env: dict[str, str], where: Path, log_path: Path, *args: str
    ) -> None:
        self.app_module, self.env, self.cwd = app_module, env, where
        self.log_path, self.args = log_path, args
        self.proc = None

    @property
    def argv(self) -> list[str]:
        return self.celery(*self.args)


def copy_example(name: str, tmp_path: Path) -> Path:
    """``examples/<name>`` copied into ``tmp_path``; the copy's folder."""
    where = tmp_path / name
    shutil.copytree(REPO_ROOT / "examples" / name, where)
    return where


def fresh_redis(*dbs: int) -> list[str]:
    """URLs of the test Redis's databases ``dbs``, emptied (the test empties them again)."""
    services.need("redis")
    urls = [services.REDIS_URL.rsplit("/", 1)[0] + f"/{db}" for db in dbs]
    empty_redis(urls)
    return urls


def empty_redis(urls: list[str]) -> None:
    for url in urls:
        services.delete_redis_keys(url, "*")


def run_in(
    where: Path, env: dict[str, str], *argv: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``python <argv>`` in ``where``, to its end."""
    return subprocess.run(
        [sys.executable, *argv],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
