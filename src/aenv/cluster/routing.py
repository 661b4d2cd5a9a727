"""Sandbox -> node routing: which node runs or keeps a sandbox, set on create, cleared on kill
(or by a gateway once the node's lease is gone and the sandbox was not parked), looked up by id
with one GET.

Each node also keeps the set of sandbox ids routed to it, so its entries can be replaced as a
whole when it republishes (see `agent`).
"""

from __future__ import annotations

from collections.abc import Iterable

import redis.asyncio as aioredis

from aenv.cluster.store import Keys, guarded, members

# KEYS: route, the new node's set. ARGV: sandbox id, node id, route prefix for the old node's set.
# Moving a route also drops the id from the previous node's set.
_SET = """
local old = redis.call('GET', KEYS[1])
if old and old ~= ARGV[2] then redis.call('SREM', ARGV[3] .. old, ARGV[1]) end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('SADD', KEYS[2], ARGV[1])
return 1
"""

# KEYS: route, the node's set. ARGV: sandbox id, node id. A route that another node took since
# (the sandbox resumed elsewhere) is left alone.
_CLEAR = """
redis.call('SREM', KEYS[2], ARGV[1])
if redis.call('GET', KEYS[1]) ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""

# KEYS: route, the node's set, the node's lease. ARGV: sandbox id, node id. Only while the node
# holds no lease: a node back in time keeps its routes.
_CLEAR_LOST = """
if redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
if redis.call('GET', KEYS[1]) ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
return 1
"""


class Routes:
    def __init__(self, client: aioredis.Redis, keys: Keys | None = None) -> None:
        self.client = client
        self.keys = keys or Keys()
        self._set = client.register_script(_SET)
        self._clear = client.register_script(_CLEAR)
        self._clear_lost = client.register_script(_CLEAR_LOST)

    async def assign(self, sandbox_id: str, node_id: str) -> None:
        async with guarded(self.client, f"routing sandbox {sandbox_id}"):
            await self._set(*self._set_args(sandbox_id, node_id))

    async def clear(self, sandbox_id: str, node_id: str) -> bool:
        """Removes the route if it still points at `node_id`; True if it did."""
        async with guarded(self.client, f"unrouting sandbox {sandbox_id}"):
            return bool(await self._clear(*self._clear_args(sandbox_id, node_id)))

    async def clear_lost(self, sandbox_id: str, node_id: str) -> bool:
        """Removes the route if it still points at `node_id` and that node's lease is gone (a
        gateway's cleanup of a sandbox lost with its node); True if it did. The node writes it
        back if it returns with the sandbox (its agent republishes on a lease taken anew)."""
        keys, args = self._clear_args(sandbox_id, node_id)
        async with guarded(self.client, f"unrouting lost sandbox {sandbox_id}"):
            return bool(await self._clear_lost([*keys, self.keys.lease(node_id)], args))

    async def lookup(self, sandbox_id: str) -> str | None:
        """The node id the sandbox is routed to, or None."""
        async with guarded(self.client, f"looking up sandbox {sandbox_id}"):
            value = await self.client.get(self.keys.route(sandbox_id))
        # The client decodes responses; redis-py's annotations allow bytes all the same.
        return value.decode() if isinstance(value, bytes) else value

    async def owners(self, sandbox_ids: list[str]) -> dict[str, str | None]:
        """The node each sandbox is routed to (None: unrouted), in one MGET."""
        if not sandbox_ids:
            return {}
        async with guarded(self.client, "looking up sandbox routes"):
            values = await self.client.mget([self.keys.route(i) for i in sandbox_ids])
        # The client decodes responses; redis-py's annotations allow bytes all the same.
        return {
            i: v.decode() if isinstance(v, bytes) else v
            for i, v in zip(sandbox_ids, values, strict=True)
        }

    async def of_node(self, node_id: str) -> set[str]:
        """The sandbox ids routed to `node_id`."""
        async with guarded(self.client, f"listing the sandboxes of node {node_id}"):
            return await members(self.client, self.keys.node_sandboxes(node_id))

    async def replace(self, node_id: str, sandbox_ids: Iterable[str]) -> None:
        """Makes the node's routes exactly `sandbox_ids`, in one transaction."""
        wanted = set(sandbox_ids)
        async with guarded(self.client, f"republishing the routes of node {node_id}"):
            current = await members(self.client, self.keys.node_sandboxes(node_id))
            async with self.client.pipeline(transaction=True) as pipe:
                for sandbox_id in current - wanted:
                    await self._clear(*self._clear_args(sandbox_id, node_id), client=pipe)
                for sandbox_id in wanted:
                    await self._set(*self._set_args(sandbox_id, node_id), client=pipe)
                await pipe.execute()

    def _set_args(self, sandbox_id: str, node_id: str) -> tuple[list[str], list[str]]:
        keys = [self.keys.route(sandbox_id), self.keys.node_sandboxes(node_id)]
        return keys, [sandbox_id, node_id, self.keys.node_sandboxes("")]

    def _clear_args(self, sandbox_id: str, node_id: str) -> tuple[list[str], list[str]]:
        keys = [self.keys.route(sandbox_id), self.keys.node_sandboxes(node_id)]
        return keys, [sandbox_id, node_id]
