"""A gateway's data plane names the cluster key a request carries to the node (its id and team,
not the key itself), whose proxy then keeps another team's key from the sandbox as one node
does (`proxy.access.check_team`). The node here is its internal gate over a real proxy with a
dict-backed resolver and an upstream app on loopback; Redis is a real redis-server."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import httpx
import pytest
import redis.asyncio as aioredis
from starlette.types import Scope

from aenv.api.internal import OPERATOR_CALLER, caller, caller_key
from aenv.cluster.internal import InternalGate
from aenv.cluster.keys import ClusterKeys
from aenv.cluster.registry import Capacity, NodeRegistry, NodeReport
from aenv.cluster.routing import Routes
from aenv.cluster.store import connect
from aenv.ids import TEAM_ID
from aenv.proxy import SandboxProxy
from tests.cluster.shared import SECRET, gateway_over
from tests.proxy.support import DictResolver, FakeSandbox, Probe, serve, upstream_app
from tests.support.ports import free_port
from tests.support.redis_server import RedisServer

SANDBOX = "teamsandbox000000001"
PORT = 8000


class NamedTeams:
    """The team a gateway names (`api.internal`); every sandbox is the default team's."""

    async def caller_team(self, scope: Scope) -> str | None:
        named = caller(scope.get("state", {}))
        return None if named in (None, OPERATOR_CALLER) else caller_key(named).team_id

    def sandbox_team(self, sandbox_id: str) -> str | None:
        return TEAM_ID if sandbox_id == SANDBOX else None


@pytest.fixture
def upstream() -> Iterator[int]:
    port = free_port()
    with serve(upstream_app(Probe()), port):
        yield port


async def test_a_gateway_names_the_key_and_its_team_to_the_node(
    redis: RedisServer, client: aioredis.Redis, upstream: int
) -> None:
    resolver = DictResolver({SANDBOX: FakeSandbox({PORT: upstream})})
    node = InternalGate(SandboxProxy(resolver, tenancy=NamedTeams()), SECRET)
    keys = ClusterKeys(client)
    _, ours = await keys.new("ours", TEAM_ID)
    _, theirs = await keys.new("theirs", "beta")
    with serve(node, free_port()) as node_url:
        capacity = Capacity(cpus=2, memory_mb=1024, memory_free_mb=512, running=1, paused=0)
        report = NodeReport("p", node_url.removeprefix("http://"), capacity, [])
        await NodeRegistry(client, SECRET).heartbeat(secrets.token_hex(8), report, ttl=60)
        await Routes(client).assign(SANDBOX, "p")
        gateway = gateway_over(connect(redis.url, timeout=0.5))
        with serve(gateway, free_port()) as url, httpx.Client(base_url=url, timeout=30) as http:
            routed = {"E2b-Sandbox-Id": SANDBOX, "E2b-Sandbox-Port": str(PORT)}
            mine = http.get("/echo", headers={**routed, "X-API-Key": ours})
            assert mine.status_code == 200, mine.text
            seen = {k for k, _ in mine.json()["headers"]}
            assert not seen & {"x-api-key", "x-aenv-caller", "x-aenv-caller-team"}, seen
            other = http.get("/echo", headers={**routed, "X-API-Key": theirs})
            assert other.status_code == 502, other.text
            assert other.json()["message"] == "The sandbox was not found"
            # A value that is no key of the cluster's is the sandbox service's own header.
            own = http.get("/echo", headers={**routed, "X-API-Key": "svc-token"})
            assert own.status_code == 200, own.text
            assert ["x-api-key", "svc-token"] in own.json()["headers"]
