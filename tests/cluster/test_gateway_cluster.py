"""End to end: two real `aenv node`s (real VMs, each in a network namespace of its own) and a real
`aenv gateway` in front of them, driven by the official Python e2b SDK pointed at the gateway
only. Creates are spread over both nodes, commands and files go through the gateway's data plane,
the list pages over the sandboxes of both, kills work, and routes change at once (the
orchestrator tells the node agent, no heartbeat waited for). A node's internal API refuses
callers without the cluster token, and a gateway with another secret does not start."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from aenv.cluster.registry import NodeRegistry
from aenv.cluster.routing import Routes
from aenv.cluster.secret import ClusterSecret
from aenv.cluster.store import connect
from aenv.config import Paths
from aenv.orchestrator.images import prepare_images
from tests.cluster.cluster_ns import Cluster, cluster
from tests.cluster.shared import SECRET
from tests.support.guest import GUEST_CACHE, MIRROR
from tests.support.redis_server import RedisServer

# Two nodes build their first template under TCG side by side: minutes on a loaded machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

SCRIPT = str(Path(__file__).parent / "sdk" / "through_gateway.py")
NODES = ["node-a", "node-b"]


def sdk(c: Cluster, *args: str) -> dict[str, Any]:
    env = {
        "E2B_API_URL": c.gateway.url,
        "E2B_SANDBOX_URL": c.gateway.url,
        "E2B_API_KEY": c.gateway.api_key,
    }
    code, out = c.gateway.run([sys.executable, SCRIPT, *args], env=env)
    assert code == 0, out + c.gateway.log.read_text()[-3000:]
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


async def test_two_nodes_behind_a_gateway_with_the_sdk(redis: RedisServer) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="aenv-cluster-gw-"))
    for node_id in NODES:
        await prepare_images(Paths(scratch / node_id).cache, GUEST_CACHE, MIRROR)
    client = connect(redis.url)
    registry, routes = NodeRegistry(client, SECRET), Routes(client)
    settings = {
        "AENV_REDIS_URL": redis.unix_url,
        "AENV_CLUSTER_SECRET": SECRET.value,
        # Longer than a create: routes must appear through the orchestrator's hook, not a beat.
        "AENV_HEARTBEAT_INTERVAL": "3",
        "AENV_LEASE_TTL": "30",
    }
    try:
        with cluster(scratch, NODES, settings) as c:
            deadline = time.monotonic() + 900
            while sorted(n.node_id for n in await registry.live()) != NODES:
                for node in c.nodes.values():
                    assert node.proc is not None and node.proc.poll() is None, node.log.read_text()
                assert time.monotonic() < deadline, "the nodes never registered"
                await asyncio.sleep(0.5)

            wrong = ClusterSecret("another-cluster-secret-0123456")
            c.gateway.start({"AENV_CLUSTER_SECRET": wrong.value}).wait(timeout=60)
            assert c.gateway.proc is not None and c.gateway.proc.returncode == 1
            assert "cluster secret differs" in c.gateway.log.read_text()

            c.gateway.start()
            c.gateway.wait_ready()
            made = sdk(c, "create", "2", "4")
            ids: list[str] = made["ids"]
            assert len(ids) == 2
            assert made["outputs"] == ["hello 0\n", "hello 1\n"]
            assert made["files"] == ["note 0", "note 1"]
            # Listed one per page: the gateway's token pages over both nodes' sandboxes.
            assert sorted(made["listed"]) == sorted(ids)
            placed = {sandbox_id: await routes.lookup(sandbox_id) for sandbox_id in ids}
            assert sorted(str(n) for n in placed.values()) == NODES, placed

            node_of = placed[ids[0]]
            assert node_of is not None
            refused = c.internal(node_of, "/internal/v2/sandboxes", None)
            assert refused.status_code == 401 and "cluster's token" in refused.json()["message"]
            wrong_token = c.internal(node_of, "/internal/v2/sandboxes", wrong.bearer)
            assert wrong_token.status_code == 401
            assert "wrong cluster token" in wrong_token.json()["message"]
            user_key = c.internal(node_of, "/internal/v2/sandboxes", c.gateway.api_key)
            assert user_key.status_code == 401
            allowed = c.internal(node_of, "/internal/v2/sandboxes", SECRET.bearer)
            assert allowed.status_code == 200, allowed.text

            gone = sdk(c, "kill", *ids)
            assert gone == {"killed": [True, True], "listed": []}
            assert [await routes.lookup(sandbox_id) for sandbox_id in ids] == [None, None]
    finally:
        await client.aclose()
        shutil.rmtree(scratch, ignore_errors=True)
