"""Private, throw-away redis-servers for tests that restart, misconfigure or fail over Redis.

The shared Redis of the machine is never restarted by a test: these tests
start their own servers on free ports, with no persistence, and stop them by
pid. :func:`redis_server` is one server; :func:`sentinel_group` a master, its
replicas (``--replicaof``) and sentinels (``redis-server FILE --sentinel``, the
file generated in the group's directory) watching it; :func:`cluster` a Redis
Cluster (``--cluster-enabled yes`` servers joined by ``redis-cli --cluster
create``). Every wait is polled against a deadline.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import pytest
import redis

from tests.integration import servers
from tests.integration.servers import free_port

#: A cluster node also listens on its port + 10000 (the cluster bus).
BUS_OFFSET = 10000


def _free_cluster_port() -> int:
    """A free port whose cluster bus port (+ :data:`BUS_OFFSET`) is free too."""
    for _ in range(200):
        port = free_port()
        if port + BUS_OFFSET > 65535:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + BUS_OFFSET))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisServer:
    """One redis-server (or, with ``sentinel``, one sentinel reading ``config``) on a free port."""

    def __init__(
        self, *extra: str, sentinel_config: str | None = None, port: int | None = None
    ) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.skip("redis-server is not installed")
        self.port = free_port() if port is None else port
        self.extra = extra
        self.dir = tempfile.mkdtemp(prefix="exactonce-redis-")
        self.sentinel_config = sentinel_config
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def client(self, timeout: float = 5.0, db: int = 0) -> redis.Redis:
        return redis.Redis(
            host="127.0.0.1", port=self.port, db=db, socket_timeout=timeout, decode_responses=True
        )

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert self.binary is not None
        head = [self.binary]
        if self.sentinel_config is not None:
            path = os.path.join(self.dir, "sentinel.conf")
            with open(path, "w", encoding="utf-8") as conf:
                conf.write(self.sentinel_config)
            head = [self.binary, path, "--sentinel"]
        self.process = subprocess.Popen(
            [
                *head,
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
def redis_server(
    *extra: str, sentinel_config: str | None = None, port: int | None = None
) -> Iterator[RedisServer]:
    server = RedisServer(*extra, sentinel_config=sentinel_config, port=port)
    server.start()
    try:
        yield server
    finally:
        server.kill()
        shutil.rmtree(server.dir, ignore_errors=True)


def wait_for(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll ``check`` until it holds (Redis errors count as not yet), else fail naming ``what``."""
    servers.wait_for(what, check, timeout, errors=(redis.RedisError, OSError))


SERVICE = "exactonce"


class SentinelGroup:
    """A master, its replicas and the sentinels watching it (service :data:`SERVICE`)."""

    def __init__(self, master: RedisServer) -> None:
        self.master = master
        self.replicas: list[RedisServer] = []
        self.sentinels: list[RedisServer] = []

    @property
    def servers(self) -> list[RedisServer]:
        return [self.master, *self.replicas]

    def url(self, db: int = 0, password: str = "") -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        auth = f":{password}@" if password else ""
        return f"redis+sentinel://{auth}{hosts}/{SERVICE}/{db}"

    def master_port(self) -> int:
        """The master's port as the first sentinel that answers says it."""
        for sentinel in self.sentinels:
            try:
                _, port = sentinel.client(1.0).sentinel_get_master_addr_by_name(SERVICE)
                return int(port)
            except (redis.RedisError, OSError, TypeError):
                continue
        raise TimeoutError("no sentinel answers")

    def current_master(self) -> RedisServer:
        port = self.master_port()
        return next(s for s in self.servers if s.port == port)

    def wait_replicas(self, count: int, timeout: float = 30.0) -> None:
        """Wait until the current master has ``count`` replicas online and caught up."""

        def ready() -> bool:
            master = self.current_master() if self.sentinels else self.master
            info = master.client(1.0).info("replication")
            online = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
            return len([v for v in online if v.get("state") == "online"]) >= count

        wait_for(f"{count} replicas online", ready, timeout)

    def failover_after_kill(self, timeout: float = 60.0) -> RedisServer:
        """SIGKILL the current master, wait for the sentinels to promote another; the new master."""
        old = self.current_master()
        old.kill()
        wait_for("a new master", lambda: self.master_port() != old.port, timeout)
        new = self.current_master()
        wait_for(
            "the new master writable",
            lambda: new.client(1.0).info("replication")["role"] == "master",
            timeout,
        )
        return new


def _sentinel_config(master_port: int, quorum: int) -> str:
    return (
        f"sentinel monitor {SERVICE} 127.0.0.1 {master_port} {quorum}\n"
        f"sentinel down-after-milliseconds {SERVICE} 1000\n"
        f"sentinel failover-timeout {SERVICE} 5000\n"
        f"sentinel parallel-syncs {SERVICE} 2\n"
    )


@contextmanager
def sentinel_group(replicas: int = 2, sentinels: int = 3) -> Iterator[SentinelGroup]:
    """A master, ``replicas`` replicas and ``sentinels`` sentinels; all killed at the end."""
    with ExitStack() as stack:
        group = SentinelGroup(stack.enter_context(redis_server()))
        for _ in range(replicas):
            group.replicas.append(
                stack.enter_context(
                    redis_server("--replicaof", "127.0.0.1", str(group.master.port))
                )
            )
        group.wait_replicas(replicas)
        config = _sentinel_config(group.master.port, max(1, sentinels // 2 + 1))
        for _ in range(sentinels):
            group.sentinels.append(stack.enter_context(redis_server(sentinel_config=config)))

        def watching() -> bool:
            for sentinel in group.sentinels:
                state = sentinel.client(1.0).sentinel_master(SERVICE)
                if int(state["num-other-sentinels"]) < sentinels - 1:
                    return False
                if int(state["num-slaves"]) < replicas:
                    return False
            return True

        wait_for("the sentinels watching the master and each other", watching)
        yield group


class Cluster:
    """A Redis Cluster: its servers (masters and replicas, as ``--cluster create`` chose)."""

    def __init__(self, servers: list[RedisServer], masters: int) -> None:
        self.servers = servers
        self.masters = masters

    def url(self, password: str = "") -> str:
        """``redis+cluster://`` naming every server (one would do: the client finds the rest)."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.servers)
        auth = f":{password}@" if password else ""
        return f"redis+cluster://{auth}{hosts}"

    def info(self, server: RedisServer) -> dict[str, str]:
        """``CLUSTER INFO`` of ``server``, as a dict of its fields."""
        info = server.client(1.0).execute_command("CLUSTER INFO")  # parsed by redis-py
        return {str(name): str(value) for name, value in dict(info).items()}

    @property
    def live(self) -> list[RedisServer]:
        """The servers running (not killed)."""
        return [s for s in self.servers if s.process is not None]

    def master_servers(self) -> list[RedisServer]:
        """The servers that are masters now."""
        return [s for s in self.live if s.client(1.0).info("replication")["role"] == "master"]

    def replicas_online(self, master: RedisServer) -> int:
        """How many replicas of ``master`` are online (synced: they acknowledge writes)."""
        info = master.client(1.0).info("replication")
        links = [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
        return sum(link.get("state") == "online" for link in links)

    def replica_of(self, master: RedisServer) -> RedisServer:
        """The first running replica of ``master``."""
        for server in self.live:
            info = server.client(1.0).info("replication")
            if info["role"] == "slave" and int(info["master_port"]) == master.port:
                return server
        raise LookupError(f"no replica of the master on port {master.port}")

    def owner(self, slot: int) -> RedisServer:
        """The master serving ``slot``, as the first running server's slot table says."""
        for first, last, (_, port, *_) in (
            (int(r[0]), int(r[1]), r[2])
            for r in self.live[0].client(1.0).execute_command("CLUSTER SLOTS")
        ):
            if first <= slot <= last:
                return next(s for s in self.servers if s.port == int(port))
        raise LookupError(f"no master serves slot {slot}")

    def failover_after_kill(
        self, slot: int, timeout: float = 60.0
    ) -> tuple[RedisServer, RedisServer]:
        """SIGKILL the master of ``slot``, wait until its replica serves the slot: (old, new).

        The cluster promotes the replica once the master has been unreachable
        for ``cluster-node-timeout`` (3 s here) and a majority of masters agree.
        """
        old = self.owner(slot)
        new = self.replica_of(old)
        old.kill()

        def promoted() -> bool:
            if new.client(1.0).info("replication")["role"] != "master":
                return False
            return self.owner(slot) is new and self.ready()

        wait_for(f"the replica on port {new.port} serving slot {slot}", promoted, timeout)
        return old, new

    def move_slot(
        self, slot: int, source: RedisServer, target: RedisServer, batch: int = 100
    ) -> int:
        """Move ``slot`` from ``source`` to ``target`` with its keys; how many keys moved.

        By hand, as ``redis-cli --cluster reshard`` does it (:class:`SlotMove`).
        """
        return self.begin_move(slot, source, target).finish(batch)

    def begin_move(self, slot: int, source: RedisServer, target: RedisServer) -> SlotMove:
        """Start moving ``slot``: IMPORTING on the target, MIGRATING on the source."""
        return SlotMove(self, slot, source, target)

    def ready(self) -> bool:
        """Every running server says ``cluster_state:ok``, every slot assigned, every node known."""
        for server in self.live:
            info = self.info(server)
            if info.get("cluster_state") != "ok" or info.get("cluster_slots_ok") != "16384":
                return False
            if int(info.get("cluster_known_nodes", 0)) < len(self.servers):
                return False
        return True


@contextmanager
def cluster(masters: int = 3, replicas_per_master: int = 1) -> Iterator[Cluster]:
    """A Redis Cluster of ``masters`` masters, each with ``replicas_per_master`` replicas.

    Each server runs ``--cluster-enabled yes`` with its own node file, no
    persistence, on a free port; ``redis-cli --cluster create`` assigns the
    slots; the cluster is ready when every node says ``cluster_state:ok``. All
    servers are killed by pid at the end.
    """
    cli = shutil.which("redis-cli")
    if cli is None:
        pytest.skip("redis-cli is not installed")
    count = masters * (1 + replicas_per_master)
    with ExitStack() as stack:
        servers = [
            stack.enter_context(
                redis_server(
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "3000",
                    "--repl-diskless-sync-delay",  # a replica syncs at once, not 5 s later
                    "0",
                    port=_free_cluster_port(),
                )
            )
            for _ in range(count)
        ]
        created = subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{s.port}" for s in servers),
                "--cluster-replicas",
                str(replicas_per_master),
                "--cluster-yes",
            ],
            capture_output=True,
            timeout=60,
            check=False,
        )
        if created.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {created.stdout!r}")
        group = Cluster(servers, masters)
        wait_for("the cluster ready (cluster_state:ok on every node)", group.ready, timeout=60)

        def synced() -> bool:
            return all(
                group.replicas_online(m) >= replicas_per_master for m in group.master_servers()
            )

        wait_for("every master's replicas online (synced)", synced, timeout=60)
        yield group


class SlotMove:
    """One slot moving between masters, step by step (a test can stop half-way).

    Made by :meth:`Cluster.begin_move`: the slot is ``IMPORTING`` on the target
    and ``MIGRATING`` on the source; :meth:`migrate` moves some keys
    (``MIGRATE``), :meth:`finish` the rest and gives the slot to the target
    (``SETSLOT NODE`` on every master).
    """

    def __init__(self, group: Cluster, slot: int, source: RedisServer, target: RedisServer) -> None:
        self.group, self.slot, self.source, self.target = group, slot, source, target
        self._src, self._dst = source.client(5.0), target.client(5.0)
        self._src_id = self._src.execute_command("CLUSTER MYID")
        self._dst_id = self._dst.execute_command("CLUSTER MYID")
        self._dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", self._src_id)
        self._src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", self._dst_id)

    def keys_left(self) -> int:
        """Keys of the slot still on the source."""
        return int(self._src.execute_command("CLUSTER COUNTKEYSINSLOT", self.slot))

    def migrate(self, limit: int | None = None, batch: int = 100) -> int:
        """``MIGRATE`` up to ``limit`` keys (all, by default) ``batch`` at a time; how many."""
        moved = 0
        while limit is None or moved < limit:
            count = batch if limit is None else min(batch, limit - moved)
            keys = self._src.execute_command("CLUSTER GETKEYSINSLOT", self.slot, count)
            if not keys:
                break
            self._src.execute_command(
                "MIGRATE", "127.0.0.1", self.target.port, "", 0, 5000, "KEYS", *keys
            )
            moved += len(keys)
        return moved

    def finish(self, batch: int = 100) -> int:
        """Migrate the keys left, then give the slot to the target; how many keys moved."""
        moved = self.migrate(batch=batch)
        for server in self.group.master_servers():
            server.client(5.0).execute_command("CLUSTER SETSLOT", self.slot, "NODE", self._dst_id)
        return moved
