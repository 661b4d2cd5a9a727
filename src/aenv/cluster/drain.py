"""Draining: the nodes that take no new sandboxes (`aenv node drain`), in one Redis set that
placement reads, and each node's own memory of whether it drains. Emptying a draining node of
its sandboxes is the drain command's work.

The node is the source of truth here as for its sandboxes: its agent keeps a file saying
whether it drains and in which Redis data set (epoch) it read that. While the data set is the
same, the Redis set is the operator's word and the file follows it (a drain or undrain made while
the node was down included); in a data set the node has not read it from (Redis wiped or
restarted without its data), the node marks itself draining again, so a drained node never comes
back `ready` on its own.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import redis.asyncio as aioredis

from aenv.atomic import write_text
from aenv.cluster.node_events import NodeEventType, xadd
from aenv.cluster.store import Keys, guarded, members

# KEYS: draining, node events. ARGV: node id, now. The event only when the set changed.
_DRAIN = f"""
if redis.call('SADD', KEYS[1], ARGV[1]) == 1 then
  {xadd("KEYS[2]", NodeEventType.DRAINED, "ARGV[1]", "ARGV[2]")}
end
return 1
"""
_UNDRAIN = f"""
if redis.call('SREM', KEYS[1], ARGV[1]) == 1 then
  {xadd("KEYS[2]", NodeEventType.UNDRAINED, "ARGV[1]", "ARGV[2]")}
end
return 1
"""


class Drains:
    def __init__(self, client: aioredis.Redis, keys: Keys | None = None) -> None:
        self.client = client
        self.keys = keys or Keys()
        self._drain = client.register_script(_DRAIN)
        self._undrain = client.register_script(_UNDRAIN)

    async def drain(self, node_id: str) -> None:
        async with guarded(self.client, f"draining node {node_id}"):
            await self._drain(self._keys, [node_id, repr(time.time())])

    async def undrain(self, node_id: str) -> None:
        async with guarded(self.client, f"undraining node {node_id}"):
            await self._undrain(self._keys, [node_id, repr(time.time())])

    @property
    def _keys(self) -> list[str]:
        return [self.keys.draining, self.keys.node_events]

    async def draining(self) -> set[str]:
        async with guarded(self.client, "listing draining nodes"):
            return await members(self.client, self.keys.draining)

    async def is_draining(self, node_id: str) -> bool:
        async with guarded(self.client, f"reading whether node {node_id} drains"):
            found = self.client.sismember(self.keys.draining, node_id)
            return bool(await cast("Awaitable[int]", found))


@dataclass(frozen=True)
class DrainState:
    draining: bool
    epoch: str | None  # the data set it was read in; None: never read


class DrainMemory:
    """A node's file saying whether it drains (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raw = {}
        self._state = DrainState(bool(raw.get("draining", False)), raw.get("epoch"))

    @property
    def state(self) -> DrainState:
        return self._state

    def remember(self, state: DrainState) -> None:
        if state == self._state:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_text(self.path, json.dumps({"draining": state.draining, "epoch": state.epoch}))
        self._state = state
