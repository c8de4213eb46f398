"""Private, throw-away PostgreSQL servers for tests that kill a primary and promote its standby.

The machine's shared PostgreSQL is never touched: :func:`pg_pair` starts its
own primary (``initdb``, trust authentication on 127.0.0.1 for clients and
for replication) and a streaming standby of it (``pg_basebackup -R``), each on
a free port with its data and sockets in the pair's temporary directory (in
``/dev/shm`` where there is one), and stops both by pid at the end, on failure
too. ``sync`` names the standby in the primary's ``synchronous_standby_names``
(``FIRST 1 (standby)``): a commit returns once the standby has flushed it;
without it the standby is asynchronous. The synchronous settings are the
primary's command line, not its configuration files, so a promoted standby
does not wait for a standby of its own.

A test can make the standby lag: :meth:`PgPair.pause_replay` (it still
receives and flushes WAL, and a promotion replays it all) or
:meth:`PgPair.cut_stream` (it receives nothing more); then
:meth:`PgServer.kill` the primary (SIGKILL, its children too) and
:meth:`PgServer.promote` the standby (:meth:`PgPair.fail_over` does both).

As root (CI, this machine) the servers run as the ``postgres`` user, since
``initdb`` refuses root. Missing binaries skip the test (set
``EXACTONCE_TEST_PG_BIN`` to their directory if they are elsewhere), as a
missing ``redis-server`` does. Every wait is polled against a deadline.
"""

from __future__ import annotations

import atexit
import glob
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from typing import Any

import psycopg
import pytest

from tests.integration import servers

#: The standby's ``cluster_name``: its ``application_name`` on the primary.
STANDBY = "standby"
_HBA = (
    "local all all trust\n"
    "host all all 127.0.0.1/32 trust\n"
    "local replication all trust\n"
    "host replication all 127.0.0.1/32 trust\n"
)


#: The server programs a pair needs, all from one installation.
_PROGRAMS = ("initdb", "postgres", "pg_ctl", "pg_basebackup")


def _bin_dir() -> str:
    """The directory of :data:`_PROGRAMS`; skips the test if there is none."""
    wanted = os.environ.get("EXACTONCE_TEST_PG_BIN")
    # Debian's layout, the newest version first (as numbers: 15 before 9.6)
    versions = glob.glob("/usr/lib/postgresql/[0-9]*/bin")
    newest = sorted(versions, key=lambda d: [int(n) for n in re.findall(r"\d+", d)], reverse=True)
    found = [wanted] if wanted else newest
    which = shutil.which("initdb")  # the directory a symlink on the PATH points into
    found += [os.path.dirname(os.path.realpath(which))] if which else []
    for directory in found:
        if all(os.access(os.path.join(directory, p), os.X_OK) for p in _PROGRAMS):
            return directory
    pytest.skip(f"the PostgreSQL server programs ({', '.join(_PROGRAMS)}) are not installed")


def _account() -> tuple[int, int] | None:
    """The uid and gid to run the servers as (``postgres`` when root); ``None``: as we are."""
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam("postgres")
    except KeyError:
        pytest.skip("running as root and there is no postgres user to run initdb as")
    return entry.pw_uid, entry.pw_gid


def wait_for(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll ``check`` until it holds (a server not answering yet: not yet), else fail."""
    servers.wait_for(what, check, timeout, errors=(psycopg.Error, OSError))


def _children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (a postmaster's backends and workers)."""
    found = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat, encoding="utf-8") as file:
                fields = file.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.split("/")[2]))
    return found


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie nobody reaps counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as file:
            return file.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _as(account: tuple[int, int] | None) -> dict[str, Any]:
    """The ``subprocess`` arguments that run a program as ``account`` (``None``: as we are)."""
    if account is None:
        return {}
    return {"user": account[0], "group": account[1], "extra_groups": []}


def _run(
    bin_dir: str, account: tuple[int, int] | None, program: str, *args: str, timeout: float = 60.0
) -> None:
    """Run ``program`` of ``bin_dir`` as ``account``; raise with its stderr if it fails."""
    done = subprocess.run(
        [os.path.join(bin_dir, program), *args],
        capture_output=True,
        timeout=timeout,
        check=False,
        **_as(account),
    )
    if done.returncode != 0:
        raise RuntimeError(f"{program} failed ({done.returncode}): {done.stderr.decode()}")


#: Where the data directories go: a memory file system if there is one. A SIGKILLed
#: server loses nothing the kernel has (what it wrote is in the page cache either
#: way); the disk would only add the fsyncs' time, which a busy machine stretches.
_SHM = "/dev/shm"  # noqa: S108 (mkdtemp makes a private directory in it)
_SCRATCH = _SHM if os.access(_SHM, os.W_OK) else None
#: Per test process: a fresh cluster's data directory, copied for each primary.
_TEMPLATES: dict[str, str] = {}


def _template(bin_dir: str, account: tuple[int, int] | None) -> str:
    """An ``initdb`` data directory with :data:`_HBA`, made once per test process."""
    if bin_dir not in _TEMPLATES:
        root = tempfile.mkdtemp(prefix="exactonce-pg-template-", dir=_SCRATCH)
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        data = os.path.join(root, "data")
        if account is not None:
            os.chown(root, *account)
        _run(bin_dir, account, "initdb", "-D", data, "-U", "postgres", "--auth=trust", "--no-sync")
        with open(os.path.join(data, "pg_hba.conf"), "w", encoding="utf-8") as hba:
            hba.write(_HBA)
        if account is not None:
            os.chown(os.path.join(data, "pg_hba.conf"), *account)
        _TEMPLATES[bin_dir] = data
    return _TEMPLATES[bin_dir]


class PgServer:
    """One postmaster on a free port of 127.0.0.1, its data and sockets under ``root``."""

    def __init__(self, root: str, name: str, bin_dir: str, account: tuple[int, int] | None) -> None:
        self.name, self.bin_dir, self.account = name, bin_dir, account
        self.data = os.path.join(root, name)
        self.log = os.path.join(root, f"{name}.log")
        self.sockets = root
        self.port = servers.free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def run(self, program: str, *args: str, timeout: float = 60.0) -> None:
        """Run one of the server's programs (``pg_ctl``...) as the server's user."""
        _run(self.bin_dir, self.account, program, *args, timeout=timeout)

    def start(self, *settings: str) -> None:
        """Start the postmaster with ``settings`` (``name=value``) over its configuration files.

        A port another process took since :func:`~tests.integration.servers.free_port`
        found it free (a test running beside) is replaced by another, twice at most.
        """
        for _ in range(3):
            options = [
                f"port={self.port}",
                "listen_addresses=127.0.0.1",
                f"unix_socket_directories={self.sockets}",
                "shared_buffers=16MB",
                "max_connections=30",
                *settings,
            ]
            with open(self.log, "ab") as log:
                start = log.tell()
                self.process = subprocess.Popen(
                    [os.path.join(self.bin_dir, "postgres"), "-D", self.data]
                    + [arg for option in options for arg in ("-c", option)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    **_as(self.account),
                )
            try:
                wait_for(f"PostgreSQL {self.name} on port {self.port}", self._answers)
                return
            except RuntimeError:
                if "already in use" not in self.tail(start):
                    raise
            self.port = servers.free_port()
        raise RuntimeError(f"PostgreSQL {self.name} found no free port")

    def _answers(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            self.process = None
            raise RuntimeError(f"PostgreSQL {self.name} exited: {self.tail()}")
        self.query("SELECT 1")
        return True

    def tail(self, start: int = 0) -> str:
        """The server's log from byte ``start``, its last 2000 characters (for a message)."""
        try:
            with open(self.log, encoding="utf-8", errors="replace") as file:
                file.seek(start)
                return file.read()[-2000:]
        except OSError:
            return ""

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres connect_timeout=2"

    def url(self, driver: str = "postgresql+psycopg") -> str:
        """A store URL on this server alone."""
        return f"{driver}://postgres@127.0.0.1:{self.port}/postgres"

    def query(self, sql: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        """Run ``sql`` on a connection of its own (autocommit); the rows it returned."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            cursor = conn.execute(sql, params)  # type: ignore[arg-type]
            return cursor.fetchall() if cursor.description else []

    def kill(self) -> None:
        """SIGKILL the postmaster and every process it forked: the host is gone.

        Nothing is shut down cleanly: what the server acknowledged is what a
        standby already has.
        """
        if self.process is None:
            return
        children = _children(self.process.pid)
        self.process.kill()
        self.process.wait(timeout=15)
        self.process = None
        for pid in children:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_for(f"the processes of {self.name} gone", lambda: all(map(_gone, children)))

    def in_recovery(self) -> bool:
        return bool(self.query("SELECT pg_is_in_recovery()")[0][0])

    def promote(self, timeout: float = 30.0) -> None:
        """``pg_ctl promote`` this standby, and wait until it takes writes."""
        self.run("pg_ctl", "promote", "-D", self.data, "-t", str(int(timeout)))
        wait_for(f"{self.name} promoted", lambda: not self.in_recovery(), timeout)


class PgPair:
    """A primary and its streaming standby (named :data:`STANDBY` on the primary)."""

    def __init__(self, primary: PgServer, standby: PgServer, sync: bool) -> None:
        self.primary, self.standby, self.sync = primary, standby, sync

    def multi_host_url(self, driver: str = "postgresql+psycopg") -> str:
        """A libpq multi-host URL: both servers, the one that takes writes chosen at connect."""
        hosts = "&".join(f"host=127.0.0.1:{s.port}" for s in (self.primary, self.standby))
        return f"{driver}://postgres@/postgres?{hosts}&target_session_attrs=read-write"

    def streaming(self) -> bool:
        """Whether the primary sees the standby streaming (and, if synchronous, as ``sync``)."""
        rows = self.primary.query(
            "SELECT sync_state FROM pg_stat_replication"
            " WHERE application_name = %s AND state = 'streaming'",
            (STANDBY,),
        )
        return bool(rows) and rows[0][0] == ("sync" if self.sync else "async")

    def caught_up(self) -> bool:
        """Whether the standby has replayed everything the primary has written so far."""
        (lsn,) = self.primary.query("SELECT pg_current_wal_lsn()::text")[0]
        rows = self.standby.query(
            "SELECT pg_wal_lsn_diff(pg_last_wal_replay_lsn(), %s::pg_lsn) >= 0", (lsn,)
        )
        return bool(rows[0][0])

    def commits_waiting(self) -> int:
        """How many of the primary's sessions wait for the synchronous standby to confirm."""
        query = "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'"
        return int(self.primary.query(query)[0][0])

    def pause_replay(self) -> None:
        """Pause the standby's replay: it still receives and flushes WAL, and applies none.

        A promotion ends the pause, and the standby replays all it received first.
        """
        self.standby.query("SELECT pg_wal_replay_pause()")
        wait_for(
            "the standby's replay paused",
            lambda: self.standby.query("SELECT pg_get_wal_replay_pause_state()")[0][0] == "paused",
        )

    def cut_stream(self) -> None:
        """Stop the standby's WAL stream: from here on the primary's writes never reach it.

        The standby forgets its ``primary_conninfo`` (``ALTER SYSTEM``, reload):
        its WAL receiver stops and does not come back. Deterministic, where
        pausing replay is not: a promoted standby still replays whatever WAL
        it had received while paused.
        """
        self.standby.query("ALTER SYSTEM SET primary_conninfo = ''")
        self.standby.query("SELECT pg_reload_conf()")
        wait_for(
            "the standby's WAL receiver stopped",
            lambda: not self.standby.query("SELECT pid FROM pg_stat_wal_receiver"),
        )
        wait_for(
            "the primary without its standby",
            lambda: not self.primary.query("SELECT pid FROM pg_stat_replication"),
        )

    def fail_over(self) -> PgServer:
        """SIGKILL the primary, promote the standby; the new primary."""
        self.primary.kill()
        self.standby.promote()
        return self.standby


@contextmanager
def pg_pair(sync: bool = True) -> Iterator[PgPair]:
    """A primary and a streaming standby, synchronous or not; both stopped at the end."""
    bin_dir, account = _bin_dir(), _account()
    with ExitStack() as stack:
        root = tempfile.mkdtemp(prefix="exactonce-pg-", dir=_SCRATCH)
        stack.callback(shutil.rmtree, root, ignore_errors=True)
        if account is not None:
            os.chown(root, *account)
        primary = PgServer(root, "primary", bin_dir, account)
        stack.callback(primary.kill)
        # cp -a keeps the owner (and the 0700 mode PostgreSQL insists on)
        subprocess.run(["cp", "-a", _template(bin_dir, account), primary.data], check=True)
        names = f"FIRST 1 ({STANDBY})" if sync else ""
        primary.start(
            "wal_level=replica",
            "max_wal_senders=5",
            "wal_keep_size=256MB",
            f"synchronous_standby_names={names}",
            "synchronous_commit=on",
        )
        standby = PgServer(root, "standby", bin_dir, account)
        stack.callback(standby.kill)
        standby.run(
            "pg_basebackup",
            *("-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres"),
            *("-D", standby.data, "-R", "-X", "stream", "-c", "fast", "--no-sync"),
        )
        standby.start(f"cluster_name={STANDBY}", "hot_standby=on")
        pair = PgPair(primary, standby, sync)
        wait_for("the standby streaming from the primary", pair.streaming)
        yield pair
