"""Where template builds run: template id -> the node a gateway placed its build on.

A build's calls (file uploads, start, status, logs) act on state only that node has (the build
VM, the uploaded files, the log in memory), so every gateway sends them there. The record
expires after `BUILD_TTL`: a build's status is read while it runs and soon after, and the
finished template is found through its published record (`aenv.cluster.saved`) from then on.
A wiped Redis loses these records; each node's agent writes back those of the builds still
waiting or running on it (`claim`) when it republishes, as it writes back its routes.
"""

from __future__ import annotations

from collections.abc import Iterable

import redis.asyncio as aioredis

from aenv.cluster.store import Keys, guarded

BUILD_TTL = 7 * 24 * 3600


class BuildPlaces:
    def __init__(self, client: aioredis.Redis, keys: Keys | None = None) -> None:
        self.client = client
        self.keys = keys or Keys()

    async def place(self, template_id: str, node_id: str) -> None:
        async with guarded(self.client, f"recording the build node of {template_id}"):
            await self.client.set(self.keys.build(template_id), node_id, ex=BUILD_TTL)

    async def claim(self, template_ids: Iterable[str], node_id: str) -> None:
        """Records `node_id` as running the builds of `template_ids` where no node is recorded:
        a gateway's placement written since (a newer build elsewhere) is the one to keep."""
        wanted = sorted(template_ids)
        if not wanted:
            return
        doing = f"recording the builds of node {node_id}"
        async with guarded(self.client, doing), self.client.pipeline(transaction=False) as pipe:
            for template_id in wanted:
                pipe.set(self.keys.build(template_id), node_id, ex=BUILD_TTL, nx=True)
            await pipe.execute()

    async def node_of(self, template_id: str) -> str | None:
        async with guarded(self.client, f"reading the build node of {template_id}"):
            node_id = await self.client.get(self.keys.build(template_id))
        return None if node_id is None else str(node_id)
