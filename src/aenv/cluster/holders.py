"""Which nodes hold which template and snapshot files, for cache-affine placement.

A file is named `template:<id>` or `snapshot:<id>`; each has the set of nodes that hold it, and
each node the set of files it holds, so a node can replace its entries as a whole. Lookups return
only nodes with a current lease.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

import redis.asyncio as aioredis

from aenv.cluster.registry import NodeRegistry
from aenv.cluster.store import Keys, guarded, members


class FileKind(enum.Enum):
    TEMPLATE = "template"
    SNAPSHOT = "snapshot"


@dataclass(frozen=True)
class FileRef:
    kind: FileKind
    name: str

    @property
    def key(self) -> str:
        return f"{self.kind.value}:{self.name}"


class Holders:
    def __init__(self, registry: NodeRegistry) -> None:
        self.registry = registry
        self.client: aioredis.Redis = registry.client
        self.keys: Keys = registry.keys

    async def add(self, node_id: str, file: FileRef) -> None:
        doing = f"recording {file.key} on node {node_id}"
        async with guarded(self.client, doing), self.client.pipeline(transaction=True) as pipe:
            pipe.sadd(self.keys.holders(file.key), node_id)
            pipe.sadd(self.keys.node_files(node_id), file.key)
            await pipe.execute()

    async def remove(self, node_id: str, file: FileRef) -> None:
        doing = f"forgetting {file.key} on node {node_id}"
        async with guarded(self.client, doing), self.client.pipeline(transaction=True) as pipe:
            pipe.srem(self.keys.holders(file.key), node_id)
            pipe.srem(self.keys.node_files(node_id), file.key)
            await pipe.execute()

    async def of(self, file: FileRef) -> set[str]:
        """The live nodes that hold `file`."""
        async with guarded(self.client, f"looking up the holders of {file.key}"):
            node_ids = sorted(await members(self.client, self.keys.holders(file.key)))
        return await self.registry.alive(node_ids)

    async def replace(self, node_id: str, files: Iterable[FileRef]) -> None:
        """Makes the node's files exactly `files`, in one transaction."""
        wanted = {f.key for f in files}
        async with guarded(self.client, f"republishing the files of node {node_id}"):
            current = await members(self.client, self.keys.node_files(node_id))
            async with self.client.pipeline(transaction=True) as pipe:
                for key in current - wanted:
                    pipe.srem(self.keys.holders(key), node_id)
                for key in wanted:
                    pipe.sadd(self.keys.holders(key), node_id)
                pipe.delete(self.keys.node_files(node_id))
                if wanted:
                    pipe.sadd(self.keys.node_files(node_id), *wanted)
                await pipe.execute()
