"""Cluster state on Redis, a SIMULATION: 100 node agents that register, heartbeat and publish
like real ones but hold no VMs, 300 sandboxes each (30,000 in all), one real redis-server on
loopback. Prints JSON.

- routing lookup (`Routes.lookup`, what a gateway does per request) p50/p99 over a Redis PING on
  the same client in the same run;
- Redis memory per routed sandbox (used_memory after publishing over before);
- the time to rebuild all routes after a FLUSHALL (every node republishes on its next beat) over
  the time of the first publish;
- a steady heartbeat (renewal, nothing changed) over a PING.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from summary import summary_ms

from aenv.cluster.agent import NodeAgent, NodeState
from aenv.cluster.registry import Capacity
from aenv.cluster.routing import Routes
from aenv.cluster.secret import ClusterSecret
from aenv.cluster.store import connect
from tests.support.redis_server import redis_server

NODES = 100
SANDBOXES_PER_NODE = 300
SAMPLES = 3000
SECRET = ClusterSecret("bench-cluster-secret-0123456789")


@dataclass
class SimulatedNode:
    """A node's catalog without VMs: ids only, as a real node reports them."""

    sandboxes: set[str]

    async def state(self) -> NodeState:
        capacity = Capacity(64, 262144, 131072, running=len(self.sandboxes), paused=0)
        return NodeState(capacity, self.sandboxes, {"base"}, set())


async def timed(calls: list[Callable[[], Awaitable[object]]], samples: int) -> list[list[float]]:
    """Each call's durations, the calls interleaved so that load on the machine hits all alike."""
    durations: list[list[float]] = [[] for _ in calls]
    for _ in range(samples):
        for call, spent in zip(calls, durations, strict=True):
            start = time.perf_counter()
            await call()
            spent.append(time.perf_counter() - start)
    return durations


async def run(url: str) -> dict[str, Any]:
    client = connect(url)
    nodes = [
        SimulatedNode({f"n{n:03}s{s:03}".ljust(20, "x") for s in range(SANDBOXES_PER_NODE)})
        for n in range(NODES)
    ]
    agents = [
        NodeAgent(client, f"node-{n:03}", f"10.1.{n // 250}.{n % 250}:3000", node, SECRET, 60)
        for n, node in enumerate(nodes)
    ]
    before = (await client.info("memory"))["used_memory"]
    start = time.perf_counter()
    await asyncio.gather(*(agent.beat() for agent in agents))
    publish = time.perf_counter() - start
    after = (await client.info("memory"))["used_memory"]

    routes = Routes(client)
    ids = [s for node in nodes for s in node.sandboxes]

    async def ping() -> None:
        await client.ping()

    lookup, ping_ = await timed([lambda: routes.lookup(random.choice(ids)), ping], SAMPLES)
    heartbeat, ping_h = await timed([agents[0].beat, ping], SAMPLES // 10)

    await client.flushall()
    start = time.perf_counter()
    republished = await asyncio.gather(*(agent.beat() for agent in agents))
    rebuild = time.perf_counter() - start
    assert all(republished)
    sample = random.sample(ids, 500)
    assert all([await routes.lookup(s) for s in sample]), "a route was not rebuilt"
    await client.aclose()
    p = summary_ms
    return {
        "simulation": True,
        "nodes": NODES,
        "sandboxes": len(ids),
        "lookup_ms": p(lookup),
        "ping_ms": p(ping_),
        "lookup_over_ping_p50": round(p(lookup)["median"] / p(ping_)["median"], 2),
        "lookup_over_ping_p99": round(p(lookup)["p99"] / p(ping_)["p99"], 2),
        "redis_bytes_per_sandbox": round((after - before) / len(ids)),
        "first_publish_s": round(publish, 3),
        "rebuild_after_flushall_s": round(rebuild, 3),
        "rebuild_over_first_publish": round(rebuild / publish, 2),
        "steady_heartbeat_ms": p(heartbeat),
        "heartbeat_over_ping_p50": round(p(heartbeat)["median"] / p(ping_h)["median"], 2),
    }


def main() -> None:
    with (
        tempfile.TemporaryDirectory(prefix="aenv-bench-cluster-") as tmp,
        redis_server(Path(tmp)) as server,
    ):
        print(json.dumps(asyncio.run(run(server.url)), indent=2))


if __name__ == "__main__":
    main()
