"""Secrets in a cluster, over a real redis-server: E2B's `/secrets` through a gateway, stored
sealed in Redis, mirrored by two nodes' agents into their own stores (the ones their egress
proxies read), updates and deletes following on both; and the sealing itself."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import AsyncExitStack, ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import httpx
import pytest
import redis.asyncio as aioredis

from aenv.cluster.agent import NodeAgent
from aenv.cluster.keys import ClusterKeys
from aenv.cluster.sealed import Sealer, Unsealable
from aenv.cluster.secret import ClusterSecret
from aenv.cluster.secrets import ClusterSecrets
from aenv.cluster.source import CatalogSource
from aenv.cluster.store import connect
from aenv.ids import TEAM_ID
from aenv.orchestrator.secrets import SecretStore
from tests.cluster.shared import SECRET, gateway_over
from tests.doubles.node import DoubleNode, double_node
from tests.proxy.support import serve
from tests.support.ports import free_port
from tests.support.redis_server import RedisServer

VALUE = "sk-live-0123456789abcdef"
NEWER = "sk-live-fedcba9876543210"
OTHER = ClusterSecret("another-cluster-secret-0123456789")


async def raw_redis(client: aioredis.Redis) -> str:
    """Everything Redis holds, as text: every key with its whole value."""
    out = []
    async for key in client.scan_iter("*"):
        kind = await client.type(key)
        if kind == "hash":
            fields = await cast("Awaitable[dict[str, str]]", client.hgetall(key))
            out.append(f"{key!s} {fields}")
        elif kind == "string":
            out.append(f"{key!s} {await cast('Awaitable[str]', client.get(key))}")
        else:
            out.append(f"{key!s} ({kind!s})")
    return "\n".join(out)


@dataclass
class Cluster:
    http: httpx.Client
    client: aioredis.Redis
    nodes: dict[str, tuple[DoubleNode, NodeAgent]]

    def stores(self) -> list[SecretStore]:
        return [node.orchestrator.secrets for node, _ in self.nodes.values()]

    async def beat(self) -> None:
        for _, agent in self.nodes.values():
            await agent.beat()


@pytest.fixture
def gateway(redis: RedisServer) -> Iterator[str]:
    gateway_client = connect(redis.url, timeout=0.5)
    gateway = gateway_over(gateway_client)
    with ExitStack() as stack:
        yield stack.enter_context(serve(gateway, free_port()))


@pytest.fixture
async def cluster(tmp_path: Path, client: aioredis.Redis, gateway: str) -> AsyncIterator[Cluster]:
    _, key = await ClusterKeys(client).new("user")
    async with AsyncExitStack() as stack:
        nodes = {}
        for name in ("a", "b"):
            node = await stack.enter_async_context(double_node(tmp_path / name))
            source = CatalogSource(node.catalog, node.templates, secrets=node.orchestrator.secrets)
            agent = NodeAgent(client, name, f"127.0.0.1:{free_port()}", source, SECRET)
            stack.push_async_callback(agent.close)
            nodes[name] = (node, agent)
        http = stack.enter_context(
            httpx.Client(base_url=gateway, headers={"X-API-Key": key}, timeout=30)
        )
        yield Cluster(http, client, nodes)


async def test_secrets_through_a_gateway_reach_every_node_sealed(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    http = cluster.http
    # A node's own secret, from before it joined: the cluster's set replaces it.
    [local, _] = cluster.stores()
    local.create(TEAM_ID, "local-only", "node-value", {})

    created = http.post(
        "/secrets", json={"name": "API-Key", "value": VALUE, "metadata": {"a": "b"}}
    )
    assert created.status_code == 201, created.text
    secret = created.json()
    assert secret["name"] == "api-key" and secret["currentVersion"] == 1
    assert secret["metadata"] == {"a": "b"}
    taken = http.post("/secrets", json={"name": "api-KEY", "value": "x"})
    assert taken.status_code == 409, taken.text
    reserved = http.post("/secrets", json={"name": "sec_x", "value": "x"})
    assert reserved.status_code == 400, reserved.text
    assert http.get("/secrets").json() == [secret]
    assert http.get(f"/secrets/{secret['secretID']}").json() == secret
    assert http.get("/secrets/API-KEY").json() == secret

    await cluster.beat()
    for store in cluster.stores():
        assert store.value("api-key") == VALUE
    assert local.value("local-only") is None

    updated = http.post(f"/secrets/{secret['secretID']}", json={"value": NEWER})
    assert updated.status_code == 200, updated.text
    assert updated.json()["currentVersion"] == 2 and updated.json()["metadata"] == {"a": "b"}
    await cluster.beat()
    for store in cluster.stores():
        assert store.value("api-key") == NEWER
        [mirrored] = store.list(TEAM_ID)
        assert mirrored.current_version == 2 and mirrored.secret_id == secret["secretID"]

    stored = await raw_redis(cluster.client)
    assert "sealed1:" in stored and "api-key" in stored
    for value in (VALUE, NEWER):
        assert value not in stored
        assert value not in caplog.text

    assert http.delete("/secrets/api-key").status_code == 204
    assert http.get("/secrets/api-key").status_code == 404
    assert http.delete("/secrets/api-key").status_code == 404
    assert http.post("/secrets/api-key", json={"value": "x"}).status_code == 404
    await cluster.beat()
    for store in cluster.stores():
        assert store.value("api-key") is None and store.list(TEAM_ID) == []
    # The name is free again once the secret is gone.
    again = http.post("/secrets", json={"name": "api-key", "value": VALUE})
    assert again.status_code == 201, again.text


async def test_secrets_list_pages_by_the_last_id(cluster: Cluster) -> None:
    made = [
        cluster.http.post("/secrets", json={"name": f"s{i}", "value": "v"}).json() for i in range(3)
    ]
    first = cluster.http.get("/secrets", params={"limit": 2})
    assert first.json() == made[:2]
    token = first.headers["X-Next-Token"]
    rest = cluster.http.get("/secrets", params={"limit": 2, "nextToken": token})
    assert rest.json() == made[2:] and "X-Next-Token" not in rest.headers
    bad = cluster.http.get("/secrets", params={"nextToken": "sec_nope"})
    assert bad.status_code == 400 and bad.json()["message"] == "invalid nextToken"


async def test_another_clusters_values_are_left_out_of_the_mirror(
    client: aioredis.Redis,
) -> None:
    ours, theirs = ClusterSecrets(client, SECRET), ClusterSecrets(client, OTHER)
    await ours.create(TEAM_ID, "ours", "v1", {})
    await theirs.create(TEAM_ID, "theirs", "v2", {})
    assert [(s.name, v) for s, v in await ours.current()] == [("ours", "v1")]


def test_a_sealed_value_opens_only_in_its_place_under_its_key() -> None:
    sealer = Sealer(SECRET)
    sealed = sealer.seal(VALUE, "secret sec_1/1")
    assert VALUE not in sealed and sealed.startswith("sealed1:")
    assert sealer.open(sealed, "secret sec_1/1") == VALUE
    assert sealer.seal(VALUE, "secret sec_1/1") != sealed  # a fresh nonce each time
    for context, key in (("secret sec_1/2", SECRET), ("secret sec_1/1", OTHER)):
        with pytest.raises(Unsealable) as refused:
            Sealer(key).open(sealed, context)
        assert VALUE not in str(refused.value)
    with pytest.raises(Unsealable, match="not a sealed value"):
        sealer.open(VALUE, "secret sec_1/1")
