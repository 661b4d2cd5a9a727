"""A node's membership over a node on doubles (its real catalog, templates and orchestrator)
and a real redis-server: settings, registration, routes following the catalog, Redis down."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from aenv.cluster.drain import DrainMemory, Drains
from aenv.cluster.holders import FileKind, FileRef
from aenv.cluster.membership import NodeSettings, membership
from aenv.cluster.registry import NodeIdTaken
from aenv.cluster.source import CatalogSource
from aenv.cluster.store import ClusterUnavailable
from aenv.cluster.webhooks import ClusterWebhooks
from aenv.config import Config, ConfigError, Paths
from aenv.orchestrator.webhooks import new_webhook
from tests.cluster.shared import SECRET
from tests.doubles.node import double_node
from tests.support.redis_server import RedisServer
from tests.support.wait import eventually


def settings(url: str, home: Path, node_id: str = "n1") -> NodeSettings:
    config = Config(
        redis_url=url, node_id=node_id, cluster_secret=SECRET.value, port=3999, home=home
    )
    return NodeSettings.of(config)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"cluster_secret": SECRET.value}, "redis_url"),
        ({"redis_url": "redis://127.0.0.1:1"}, "cluster_secret .* is required"),
        ({"redis_url": "redis://x", "cluster_secret": "short"}, "at least 16 characters"),
        (
            {"redis_url": "redis://x", "cluster_secret": SECRET.value, "heartbeat_interval": 20},
            "below lease_ttl",
        ),
    ],
)
def test_settings_name_what_is_missing(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        NodeSettings.of(Config.model_validate(fields))


def test_settings_defaults() -> None:
    found = NodeSettings.of(Config(redis_url="redis://x", cluster_secret=SECRET.value, port=3999))
    assert found.address == "0.0.0.0:3999" and found.node_id
    assert found.interval < found.ttl


async def test_routes_follow_the_nodes_catalog(tmp_path: Path, redis: RedisServer) -> None:
    async with double_node(tmp_path / "node") as node:
        source = CatalogSource(node.catalog, node.templates)
        async with membership(settings(redis.url, tmp_path / "node"), source) as agent:
            [report] = await agent.registry.live()
            assert report.address == "0.0.0.0:3999" and report.templates == ["base"]
            assert await agent.holders.of(FileRef(FileKind.TEMPLATE, "base")) == {"n1"}
            record, _ = await node.orchestrator.create(node.request())
            await agent.beat()
            assert await agent.routes.lookup(record.id) == "n1"
            [report] = await agent.registry.live()
            assert (report.capacity.running, report.capacity.paused) == (1, 0)
            # A paused sandbox stays on the node: still routed, counted as paused.
            await node.orchestrator.pause(record.id)
            await agent.beat()
            assert await agent.routes.lookup(record.id) == "n1"
            [report] = await agent.registry.live()
            assert (report.capacity.running, report.capacity.paused) == (0, 1)
            await node.orchestrator.kill(record.id)
            await agent.beat()
            assert await agent.routes.lookup(record.id) is None
        # Leaving gives the node id up at once.
        assert await agent.registry.live() == []


async def test_a_taken_node_id_fails_at_start(tmp_path: Path, redis: RedisServer) -> None:
    async with double_node(tmp_path / "node") as node:
        source = CatalogSource(node.catalog, node.templates)
        async with membership(settings(redis.url, tmp_path / "node"), source):
            with pytest.raises(NodeIdTaken, match="node id n1 is held by another live process"):
                async with membership(settings(redis.url, tmp_path / "node"), source):
                    raise AssertionError("a second process joined under the same id")


async def test_a_node_starts_and_serves_with_redis_down(tmp_path: Path, redis: RedisServer) -> None:
    redis.stop()
    async with double_node(tmp_path / "node") as node:
        source = CatalogSource(node.catalog, node.templates)
        fast = settings(redis.url, tmp_path / "node")
        fast = dataclasses.replace(fast, interval=0.05, ttl=30)
        async with membership(fast, source) as agent:
            assert not agent.status.connected
            record, _ = await node.orchestrator.create(node.request())
            assert node.row(record.id).state.public == "running"
            redis.start()

            async def routed() -> bool:
                try:
                    return await agent.routes.lookup(record.id) == "n1"
                except ClusterUnavailable:  # Redis is still starting
                    return False

            await eventually(routed, "the node registered once Redis came up")
            await node.orchestrator.kill(record.id)


async def test_a_drained_node_stays_drained_when_redis_forgets(
    tmp_path: Path, redis: RedisServer
) -> None:
    """Redis restarts without its data: the node marks itself draining again, from its own
    memory of it (in its data directory, so across its own restarts too)."""
    fast = dataclasses.replace(settings(redis.url, tmp_path / "node"), interval=0.05)
    memory = Paths(tmp_path / "node").cluster_drain
    async with double_node(tmp_path / "node") as node:
        source = CatalogSource(node.catalog, node.templates)
        async with membership(fast, source) as agent:
            await Drains(agent.client).drain("n1")

            async def remembered() -> bool:
                return DrainMemory(memory).state.draining

            await eventually(remembered, "the node noted its drain")
        redis.restart()
        async with membership(fast, source) as agent:
            assert await Drains(agent.client).draining() == {"n1"}


async def test_the_drain_memory_given_is_the_one_the_agent_keeps(
    tmp_path: Path, redis: RedisServer
) -> None:
    """`aenv node` shares one memory of the drain between its agent and its internal API,
    which refuses creates while it says draining: a drain in Redis reaches that object."""
    fast = dataclasses.replace(settings(redis.url, tmp_path / "node"), interval=0.05)
    shared = DrainMemory(fast.drain_file)
    async with double_node(tmp_path / "node") as node:
        source = CatalogSource(node.catalog, node.templates)
        async with membership(fast, source, shared) as agent:
            assert agent.drain is shared
            await Drains(agent.client).drain("n1")

            async def noted() -> bool:
                return shared.state.draining

            await eventually(noted, "the shared memory never noted the drain")


async def test_the_clusters_webhooks_replace_the_nodes_own(
    tmp_path: Path, redis: RedisServer
) -> None:
    async with double_node(tmp_path / "node") as node:
        store = node.orchestrator.webhooks.store
        own = store.create("local", "own", "https://own.example.com/", True, ["x"], "s1")
        source = CatalogSource(node.catalog, node.templates, webhooks=node.orchestrator.webhooks)
        async with membership(settings(redis.url, tmp_path / "node"), source) as agent:
            shared = new_webhook("local", "shared", "https://hooks.example.com/", True, ["x"], "s2")
            await ClusterWebhooks(agent.client).put(shared)
            await agent.beat()
            assert store.list("local") == [shared]
            assert store.get("local", own.id) is None
