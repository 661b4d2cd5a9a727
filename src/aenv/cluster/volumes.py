"""Where volumes live: volume id -> the node whose disk holds its files, and names -> ids.

A volume's files are one node's (a directory shared into its guests over virtio-9p), so its
calls and the sandboxes that mount it go to that node. Names are unique across the cluster: a
gateway reserves the name (`HSETNX`, value "") before a node creates the volume, and records
the id once it has. The node stays the source of truth: a record lost with a Redis wipe is
found again by asking the live nodes (`aenv.gateway.volumes`).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import cast

import redis.asyncio as aioredis

from aenv.cluster.store import Keys, guarded


@dataclass(frozen=True)
class VolumePlace:
    volume_id: str
    name: str
    node_id: str


class VolumePlaces:
    def __init__(self, client: aioredis.Redis, keys: Keys | None = None) -> None:
        self.client = client
        self.keys = keys or Keys()

    async def reserve(self, name: str) -> bool:
        """Claims `name` for a volume about to be created; False when it is taken."""
        async with guarded(self.client, f"reserving volume name {name}"):
            taken = await self.client.hsetnx(self.keys.volume_names, name, "")
        return bool(taken)

    async def unreserve(self, name: str) -> None:
        """Gives up a reservation whose create failed (a recorded name is left alone)."""
        async with guarded(self.client, f"releasing volume name {name}"):
            current = await cast(
                "Awaitable[str | None]", self.client.hget(self.keys.volume_names, name)
            )
            if current == "":
                await self.client.hdel(self.keys.volume_names, name)

    async def record(self, volume_id: str, name: str, node_id: str) -> None:
        doing = f"recording volume {volume_id}"
        async with guarded(self.client, doing), self.client.pipeline(transaction=True) as pipe:
            pipe.set(self.keys.volume(volume_id), json.dumps({"node": node_id, "name": name}))
            pipe.hset(self.keys.volume_names, name, volume_id)
            await pipe.execute()

    async def forget(self, volume_id: str, name: str) -> None:
        doing = f"forgetting volume {volume_id}"
        async with guarded(self.client, doing), self.client.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.volume(volume_id))
            pipe.hdel(self.keys.volume_names, name)
            await pipe.execute()

    async def find(self, ref: str) -> VolumePlace | None:
        """The volume named or with the id `ref`, where it lives; None when not recorded."""
        async with guarded(self.client, f"finding volume {ref}"):
            volume_id = await cast(
                "Awaitable[str | None]", self.client.hget(self.keys.volume_names, ref)
            )
            volume_id = volume_id or ref
            found = await cast(
                "Awaitable[str | None]", self.client.get(self.keys.volume(volume_id))
            )
        if found is None:
            return None
        place = json.loads(found)
        return VolumePlace(volume_id, place["name"], place["node"])
