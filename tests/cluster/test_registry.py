"""The node registry against a real redis-server: leases, their expiry, concurrent
registration, and one process per node id."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import redis.asyncio as aioredis

from aenv.cluster.registry import (
    Capacity,
    NodeIdTaken,
    NodeRegistry,
    NodeReport,
    WrongClusterSecret,
)
from aenv.cluster.secret import ClusterSecret, WeakSecret
from aenv.cluster.store import members
from tests.cluster.shared import SECRET
from tests.support.wait import eventually

CAPACITY = Capacity(cpus=2, memory_mb=24576, memory_free_mb=20000, running=3, paused=1)


def report(
    node_id: str, templates: Sequence[str] = (), snapshots: Sequence[str] = ()
) -> NodeReport:
    return NodeReport(node_id, f"{node_id}.nodes.test:3000", CAPACITY, templates, snapshots)


async def wait_gone(registry: NodeRegistry, node_id: str) -> None:
    async def lapsed() -> bool:
        return node_id not in {n.node_id for n in await registry.live()}

    await eventually(lapsed, f"{node_id}'s lease lapsed", interval=0.05)


async def test_heartbeat_registers_and_reports(client: aioredis.Redis) -> None:
    registry = NodeRegistry(client, SECRET)
    sent = report("n1", templates=["base"], snapshots=["s1", "s2"])
    lease = await registry.heartbeat("token-a", sent, ttl=30)
    assert lease.node_id == "n1" and lease.epoch
    [listed] = await registry.live()
    assert listed == NodeReport(
        "n1", sent.address, CAPACITY, ["base"], ["s1", "s2"], sent.reported_at
    )
    assert 0 < await client.pttl(registry.keys.node("n1")) <= 30_000


async def test_a_lapsed_lease_is_gone_and_the_id_free(client: aioredis.Redis) -> None:
    registry = NodeRegistry(client, SECRET)
    await registry.heartbeat("token-a", report("n1"), ttl=0.2)
    await registry.heartbeat("token-b", report("n2"), ttl=30)
    await wait_gone(registry, "n1")
    assert [n.node_id for n in await registry.live()] == ["n2"]
    assert await members(client, registry.keys.nodes) == {"n2"}
    assert await registry.alive(["n1", "n2"]) == {"n2"}
    # The id is free again: a new process takes it.
    await registry.heartbeat("token-c", report("n1"), ttl=30)
    assert await registry.alive(["n1"]) == {"n1"}


async def test_renewal_keeps_the_lease(client: aioredis.Redis) -> None:
    registry = NodeRegistry(client, SECRET)
    await registry.heartbeat("token-a", report("n1"), ttl=30)
    # Most of the lease gone, played without a wait (a test that slept through part of a
    # short lease failed when the host stalled longer than the rest).
    for key in (registry.keys.lease("n1"), registry.keys.node("n1")):
        await client.pexpire(key, 1000)
    await registry.heartbeat("token-a", report("n1"), ttl=30)
    for key in (registry.keys.lease("n1"), registry.keys.node("n1")):
        assert await client.pttl(key) > 1000
    assert await registry.alive(["n1"]) == {"n1"}


async def test_concurrent_registration_of_many_nodes(client: aioredis.Redis) -> None:
    registry = NodeRegistry(client, SECRET)
    ids = [f"node-{i:02}" for i in range(40)]
    await asyncio.gather(*(registry.heartbeat(f"t-{i}", report(i), ttl=30) for i in ids))
    assert [n.node_id for n in await registry.live()] == ids
    # One data set, one epoch, whoever registered first.
    assert len({(await registry.heartbeat(f"t-{i}", report(i), ttl=30)).epoch for i in ids}) == 1


async def test_one_process_per_node_id(client: aioredis.Redis) -> None:
    registry = NodeRegistry(client, SECRET)
    tokens = [f"process-{i}" for i in range(10)]
    results = await asyncio.gather(
        *(registry.heartbeat(t, report("n1"), ttl=30) for t in tokens), return_exceptions=True
    )
    winners = [t for t, r in zip(tokens, results, strict=True) if not isinstance(r, Exception)]
    assert len(winners) == 1
    assert all(isinstance(r, NodeIdTaken) for r in results if isinstance(r, Exception))
    with pytest.raises(NodeIdTaken, match="n1 is held by another live process"):
        await registry.heartbeat("intruder", report("n1"), ttl=30)
    # Only the holder can release the id.
    assert not await registry.release("intruder", "n1")
    assert await registry.release(winners[0], "n1")
    assert await registry.live() == []


async def test_a_node_with_another_secret_is_refused(client: aioredis.Redis) -> None:
    await NodeRegistry(client, SECRET).heartbeat("token-a", report("n1"), ttl=30)
    other = NodeRegistry(client, ClusterSecret("another-secret-of-the-same-length"))
    with pytest.raises(WrongClusterSecret, match="node n2 refused: its cluster secret differs"):
        await other.heartbeat("token-b", report("n2"), ttl=30)
    assert [n.node_id for n in await NodeRegistry(client, SECRET).live()] == ["n1"]
    # Redis keeps a fingerprint, not the secret.
    assert SECRET.value not in str(await client.get(NodeRegistry(client, SECRET).keys.secret))


def test_a_short_secret_is_refused() -> None:
    with pytest.raises(WeakSecret, match="at least 16 characters"):
        ClusterSecret("short")
