"""Creates under way on each node, counted by the gateways that send them, so that creates
started together spread over the nodes: a node's report says how busy it was at its last
heartbeat, which does not count the creates sent to it since.

Each create (or build) a gateway sends to a node is an entry of `{aenv}:node-creates:<node>`, a
sorted set of tokens scored by when the entry lapses (should that gateway die first). The
gateway removes it once the node answered; by then the node has written its report again with
the new sandbox counted (`agent.NodeAgent.sandbox_routed`). Placement adds a node's entries to
its running count (`directory.Directory.placeable`).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence

import redis.asyncio as aioredis

from aenv.cluster.store import Keys, guarded

# Longer than a create may take (a gateway waits 10 minutes for a node's answer).
LAPSE_S = 900.0


class Creating:
    def __init__(self, client: aioredis.Redis, keys: Keys | None = None) -> None:
        self.client = client
        self.keys = keys or Keys()

    async def begin(self, node_id: str) -> str:
        """Counts one create on the node; the token that `end` takes."""
        token = secrets.token_hex(8)
        lapses = time.time() + LAPSE_S
        async with guarded(self.client, f"counting a create on node {node_id}"):
            await self.client.zadd(self.keys.node_creates(node_id), {token: lapses})
        return token

    async def end(self, node_id: str, token: str) -> None:
        async with guarded(self.client, f"uncounting a create on node {node_id}"):
            await self.client.zrem(self.keys.node_creates(node_id), token)

    async def counts(self, node_ids: Sequence[str]) -> dict[str, int]:
        """The creates under way on each node, lapsed entries dropped."""
        if not node_ids:
            return {}
        now = time.time()
        doing = "counting creates under way"
        async with guarded(self.client, doing), self.client.pipeline(transaction=False) as pipe:
            for node_id in node_ids:
                pipe.zremrangebyscore(self.keys.node_creates(node_id), "-inf", now)
                pipe.zcard(self.keys.node_creates(node_id))
            found = await pipe.execute()
        return {n: int(c) for n, c in zip(node_ids, found[1::2], strict=True)}
