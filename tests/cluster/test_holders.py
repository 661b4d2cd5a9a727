"""Which nodes hold which template and snapshot files, against a real redis-server."""

from __future__ import annotations

import redis.asyncio as aioredis

from aenv.cluster.holders import FileKind, FileRef, Holders
from aenv.cluster.registry import Capacity, NodeRegistry, NodeReport
from aenv.cluster.store import members
from tests.cluster.shared import SECRET
from tests.support.wait import eventually

BASE = FileRef(FileKind.TEMPLATE, "base")
SNAP = FileRef(FileKind.SNAPSHOT, "snap1")


async def register(registry: NodeRegistry, node_id: str, ttl: float) -> None:
    capacity = Capacity(cpus=2, memory_mb=4096, memory_free_mb=4096, running=0, paused=0)
    await registry.heartbeat(f"t-{node_id}", NodeReport(node_id, "a:1", capacity), ttl)


async def test_holders_are_the_live_nodes_that_hold_a_file(client: aioredis.Redis) -> None:
    registry = NodeRegistry(client, SECRET)
    holders = Holders(registry)
    await register(registry, "n1", ttl=30)
    await register(registry, "n2", ttl=30)
    await holders.add("n1", BASE)
    await holders.add("n2", BASE)
    await holders.add("n2", SNAP)
    assert await holders.of(BASE) == {"n1", "n2"}
    # A snapshot and a template of the same name are different files.
    assert await holders.of(FileRef(FileKind.TEMPLATE, "snap1")) == set()
    # n2's lease lapses now: a short lease from the start lapsed, on a stalled host, before
    # the checks above that it holds.
    for key in (registry.keys.lease("n2"), registry.keys.node("n2")):
        await client.pexpire(key, 1)

    async def released() -> bool:
        return not await holders.of(SNAP)

    await eventually(released, "n2's lease lapsed", interval=0.05)
    assert await holders.of(BASE) == {"n1"}
    await holders.remove("n1", BASE)
    assert await holders.of(BASE) == set()


async def test_replace_makes_a_nodes_files_exact(client: aioredis.Redis) -> None:
    registry = NodeRegistry(client, SECRET)
    holders = Holders(registry)
    await register(registry, "n1", ttl=30)
    await holders.add("n1", BASE)
    await holders.replace("n1", [SNAP])
    assert await holders.of(BASE) == set()
    assert await holders.of(SNAP) == {"n1"}
    assert await members(client, registry.keys.node_files("n1")) == {"snapshot:snap1"}
