"""End to end: a real `aenv node` (real VMs, in a network namespace of its own) registers in a
real redis-server, routes the sandboxes it creates and kills, and leaves the cluster when it
stops. Redis is reached over its unix socket, which crosses network namespaces."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from aenv.cluster.registry import NodeRegistry
from aenv.cluster.routing import Routes
from aenv.cluster.store import connect
from aenv.config import Paths
from aenv.orchestrator.images import prepare_images
from tests.cluster.shared import SECRET
from tests.e2e.server_ns import ServerNs, server_in_namespace
from tests.support.guest import GUEST_CACHE, MIRROR
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.slow

# Runs in the node's namespace: one API call, its JSON answer on stdout.
CALL = """
import httpx, json, sys
method, path, body, key = sys.argv[1:5]
r = httpx.request(method, "http://127.0.0.1:3000" + path, headers={"X-API-Key": key},
                  json=json.loads(body) if body else None, timeout=300)
print(json.dumps({"status": r.status_code, "body": r.text}))
"""


def call(node: ServerNs, method: str, path: str, body: str = "") -> tuple[int, str]:
    key = Paths(node.home).api_key.read_text().strip()
    code, out = node.run(sys.executable, "-c", CALL, method, path, body, key, timeout=300)
    assert code == 0, out
    answer = json.loads(out.strip().splitlines()[-1])
    return answer["status"], answer["body"]


async def eventually(node: ServerNs, check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + 900
    while not await check():
        assert node.proc is not None and node.proc.poll() is None, node.log.read_text()[-3000:]
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.5)


async def test_a_real_node_joins_routes_and_leaves(redis: RedisServer) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="aenv-cluster-node-"))
    home = scratch / "home"
    await prepare_images(Paths(home).cache, GUEST_CACHE, MIRROR)
    client = connect(redis.url)
    registry, routes = NodeRegistry(client, SECRET), Routes(client)
    settings = {
        "AENV_REDIS_URL": redis.unix_url,
        "AENV_CLUSTER_SECRET": SECRET.value,
        "AENV_NODE_ID": "node-a",
        "AENV_HEARTBEAT_INTERVAL": "0.5",
        "AENV_LEASE_TTL": "5",
    }
    try:
        with server_in_namespace(home, command="node", settings=settings) as node:

            async def registered() -> bool:
                return [n.node_id for n in await registry.live()] == ["node-a"]

            await eventually(node, registered, "the node never registered")
            [report] = await registry.live()
            assert "base" in report.templates and report.address == "127.0.0.1:3000"
            status, body = call(node, "POST", "/sandboxes", '{"templateID": "base"}')
            assert status == 201, body
            sandbox_id = json.loads(body)["sandboxID"]

            async def routed() -> bool:
                return await routes.lookup(sandbox_id) == "node-a"

            await eventually(node, routed, "the new sandbox was never routed")
            status, body = call(node, "DELETE", f"/sandboxes/{sandbox_id}")
            assert status == 204, body

            async def unrouted() -> bool:
                return await routes.lookup(sandbox_id) is None

            await eventually(node, unrouted, "the killed sandbox stayed routed")
            node.stop()
            # A clean stop gives the node id up at once, without waiting for the lease.
            assert await registry.live() == []
    finally:
        await client.aclose()
        shutil.rmtree(scratch, ignore_errors=True)
