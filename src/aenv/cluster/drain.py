"""Draining: the nodes that take no new sandboxes (`aenv node drain`), in one Redis set that
placement reads. Emptying a draining node of its sandboxes is the drain command's work."""

from __future__ import annotations

import redis.asyncio as aioredis

from aenv.cluster.store import Keys, guarded, members


class Drains:
    def __init__(self, client: aioredis.Redis, keys: Keys | None = None) -> None:
        self.client = client
        self.keys = keys or Keys()

    async def drain(self, node_id: str) -> None:
        async with guarded(self.client, f"draining node {node_id}"):
            await self.client.sadd(self.keys.draining, node_id)

    async def undrain(self, node_id: str) -> None:
        async with guarded(self.client, f"undraining node {node_id}"):
            await self.client.srem(self.keys.draining, node_id)

    async def draining(self) -> set[str]:
        async with guarded(self.client, "listing draining nodes"):
            return await members(self.client, self.keys.draining)
