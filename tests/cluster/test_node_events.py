"""A cluster's node events against a real redis-server: a node back at each lease taken anew,
failed once when its lease lapsed unreleased (noticed by a look, or by its own return), and
drained or undrained when that changes; listed newest first, per node."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from aenv.cluster.drain import Drains
from aenv.cluster.node_events import NodeEvents, NodeEventType
from aenv.cluster.registry import NodeRegistry
from tests.cluster.shared import SECRET
from tests.cluster.test_registry import report, wait_gone
from tests.support.wait import eventually

BACK, FAILED = NodeEventType.BACK, NodeEventType.FAILED
DRAINED, UNDRAINED = NodeEventType.DRAINED, NodeEventType.UNDRAINED


async def _kinds(events: NodeEvents, node_id: str | None = None) -> list[tuple[str, str]]:
    """Oldest first: (type, node)."""
    return [(e.type.value, e.node_id) for e in reversed(await events.list(100, node_id))]


async def test_a_lapse_noticed_by_looks_is_one_failure(client: aioredis.Redis) -> None:
    registry, events = NodeRegistry(client, SECRET), NodeEvents(client)
    await registry.heartbeat("token-a", report("n1"), ttl=0.2)
    await registry.heartbeat("token-a", report("n1"), ttl=0.2)  # a renewal: no event
    await registry.heartbeat("token-b", report("n2"), ttl=30)
    await wait_gone(registry, "n1")
    # Two gateways looking at once: one failure.
    await asyncio.gather(NodeRegistry(client, SECRET).live(), registry.live())
    await registry.heartbeat("token-c", report("n1"), ttl=30)
    assert await _kinds(events) == [
        (BACK, "n1"),
        (BACK, "n2"),
        (FAILED, "n1"),
        (BACK, "n1"),
    ]
    assert await _kinds(events, "n2") == [(BACK, "n2")]
    newest = await events.list(1)
    assert [(e.type, e.node_id) for e in newest] == [(BACK, "n1")]
    assert newest[0].at > 0 and newest[0].to_json()["nodeID"] == "n1"


async def test_a_lapse_nobody_looked_at_is_recorded_at_the_return(
    client: aioredis.Redis,
) -> None:
    registry, events = NodeRegistry(client, SECRET), NodeEvents(client)
    await registry.heartbeat("token-a", report("n1"), ttl=0.1)

    async def lapsed() -> bool:  # no `live()`: nothing drops the id
        return await registry.lease_left("n1") is None

    await eventually(lapsed, "n1's lease lapsed", interval=0.05)
    await registry.heartbeat("token-b", report("n1"), ttl=30)
    assert await _kinds(events) == [(BACK, "n1"), (FAILED, "n1"), (BACK, "n1")]


async def test_a_released_node_did_not_fail(client: aioredis.Redis) -> None:
    registry, events = NodeRegistry(client, SECRET), NodeEvents(client)
    await registry.heartbeat("token-a", report("n1"), ttl=30)
    assert await registry.release("token-a", "n1")
    await registry.heartbeat("token-b", report("n1"), ttl=30)
    assert await _kinds(events) == [(BACK, "n1"), (BACK, "n1")]


async def test_drains_are_recorded_when_they_change(client: aioredis.Redis) -> None:
    drains, events = Drains(client), NodeEvents(client)
    await drains.drain("n1")
    await drains.drain("n1")
    await drains.undrain("n1")
    await drains.undrain("n1")
    assert await _kinds(events) == [(DRAINED, "n1"), (UNDRAINED, "n1")]
