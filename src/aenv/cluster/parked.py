"""Paused sandboxes any node can resume: their records, published beside the routes, whose
checkpoints are in the cluster's shared snapshot repository.

A node publishes each of its paused sandboxes whose newest checkpoint reached the repository (its
agent, every heartbeat), and withdraws it when that stops being so; a sandbox released for a
drain is published by nobody (`released`), so no node withdraws it. When a sandbox's node is gone
or gave it up, a gateway claims the move (`claim`: one gateway at a time), has another node adopt
the record, and removes it here (`remove`): the adopting node holds the truth from then on.
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from typing import cast

import redis.asyncio as aioredis

from aenv.cluster.store import Keys, guarded

# KEYS: the parked hash. ARGV: node id. Only the publishing node's own entry goes.
_WITHDRAW = """
if redis.call('HGET', KEYS[1], 'node') ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""


# KEYS: the parked hash. ARGV: node id, record. A released record (no publisher) is left alone:
# its node gave it up, and a heartbeat that read the node's catalog before must not take it back.
_PUBLISH = """
if redis.call('HGET', KEYS[1], 'node') == '' then return 0 end
redis.call('HSET', KEYS[1], 'node', ARGV[1], 'record', ARGV[2])
return 1
"""


@dataclass(frozen=True)
class ParkedSandbox:
    sandbox_id: str
    node_id: str  # who published it; "" once released
    record: str  # `aenv.orchestrator.catalog.record_to_json`


class Parked:
    def __init__(self, client: aioredis.Redis, keys: Keys | None = None) -> None:
        self.client = client
        self.keys = keys or Keys()
        self._withdraw = client.register_script(_WITHDRAW)
        self._publish = client.register_script(_PUBLISH)

    async def publish(self, node_id: str, sandbox_id: str, record: str) -> bool:
        """Publishes the record as `node_id`'s unless it was released; True if it did."""
        async with guarded(self.client, f"publishing paused sandbox {sandbox_id}"):
            keys = [self.keys.parked(sandbox_id)]
            return bool(await self._publish(keys, [node_id, record]))

    async def released(self, sandbox_id: str, record: str) -> None:
        """A record its node gave up (a drain): no node withdraws it, an adopter removes it."""
        async with guarded(self.client, f"publishing released sandbox {sandbox_id}"):
            key = self.keys.parked(sandbox_id)
            await self.client.hset(key, mapping={"node": "", "record": record})

    async def withdraw(self, node_id: str, sandbox_id: str) -> bool:
        """Removes the record if `node_id` published it; True if it did."""
        async with guarded(self.client, f"withdrawing paused sandbox {sandbox_id}"):
            return bool(await self._withdraw([self.keys.parked(sandbox_id)], [node_id]))

    async def get(self, sandbox_id: str) -> ParkedSandbox | None:
        async with guarded(self.client, f"reading paused sandbox {sandbox_id}"):
            key = self.keys.parked(sandbox_id)
            fields = await cast("Awaitable[dict[str, str]]", self.client.hgetall(key))
        if "record" not in fields:
            return None
        return ParkedSandbox(sandbox_id, fields.get("node", ""), fields["record"])

    async def remove(self, sandbox_id: str) -> None:
        async with guarded(self.client, f"removing paused sandbox {sandbox_id}"):
            await self.client.delete(self.keys.parked(sandbox_id))

    async def claim(self, sandbox_id: str, who: str, ttl: float) -> bool:
        """Whether `who` may move the sandbox now; the claim lapses after `ttl` seconds."""
        async with guarded(self.client, f"claiming the move of sandbox {sandbox_id}"):
            key = self.keys.moving(sandbox_id)
            return bool(await self.client.set(key, who, nx=True, px=int(ttl * 1000)))

    async def unclaim(self, sandbox_id: str) -> None:
        async with guarded(self.client, f"ending the move of sandbox {sandbox_id}"):
            await self.client.delete(self.keys.moving(sandbox_id))
