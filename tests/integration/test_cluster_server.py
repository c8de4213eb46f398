"""The test plumbing's Redis Cluster: six servers joined, three masters owning every slot.

The store on a cluster: tests/integration/test_cluster.py.
"""

from __future__ import annotations

import os

import pytest

from tests.integration.redis_server import cluster

pytestmark = pytest.mark.timeout(120)


def test_a_cluster_of_three_masters_with_a_replica_each_serves_every_slot() -> None:
    with cluster(masters=3, replicas_per_master=1) as group:
        pids = [server.pid for server in group.servers]
        assert len(pids) == 6
        info = group.info(group.servers[0])
        assert (info["cluster_state"], info["cluster_size"]) == ("ok", "3")
        assert info["cluster_known_nodes"] == "6"
        roles = [s.client(1.0).info("replication")["role"] for s in group.servers]
        assert sorted(roles) == ["master"] * 3 + ["slave"] * 3
        assert group.url().startswith("redis+cluster://127.0.0.1:")
        assert group.url().count(",") == 5
    # every server stopped by its pid
    for pid in pids:
        assert pid is not None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
