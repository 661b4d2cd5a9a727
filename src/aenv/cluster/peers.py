"""Peers before S3: which nodes hold which repository manifest's chunks, for restores to ask.

A node that stores or restores a manifest holds its chunks in its chunk cache afterwards; it
adds itself to the manifest's holders (`Keys.chunk_holders`, a set of node ids). A node
restoring that manifest asks those holders that have a current lease, in random order (the load
spreads over them), for each chunk its own cache lacks, over their internal API
(`GET /internal/cluster/chunks/<digest>`, `api.chunks`) with the cluster token, before it reads
the store (the repository's `sources` module checks every answer against its digest and leaves
a failing peer out for the rest of the restore). A holder whose cache has since evicted the
chunks answers 404, which sends its asker on. The set goes with the manifest; a dead node's
entry is skipped (no lease) and harmless.

Redis being down costs nothing but the peers: the directory then names none, and the store
serves every chunk, as on a node outside a cluster.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from aenv.api.chunks import CHUNK_ROUTE
from aenv.cluster.directory import NodeAddress
from aenv.cluster.internal import PREFIX, TOKEN_HEADER
from aenv.cluster.registry import NodeRegistry
from aenv.cluster.secret import ClusterSecret
from aenv.cluster.store import ClusterUnavailable, Keys, guarded, members

log = logging.getLogger("aenv.cluster")

_CHUNKS = PREFIX + CHUNK_ROUTE.removesuffix("{digest}")


@dataclass(frozen=True)
class Peer:
    """A holder as the repository asks it: a chunk is a GET of `url` + its digest."""

    name: str  # its node id
    url: str
    headers: Mapping[str, str] = field(repr=False)


class ClusterPeers:
    """The cluster's peer directory (the repository's `PeerDirectory`) for node `node_id`."""

    def __init__(self, registry: NodeRegistry, node_id: str, secret: ClusterSecret) -> None:
        self.registry = registry
        self.client: aioredis.Redis = registry.client
        self.keys: Keys = registry.keys
        self.node_id = node_id
        self._headers = {TOKEN_HEADER: secret.bearer}

    async def peers(self, manifest_id: str) -> Sequence[Peer]:
        try:
            async with guarded(self.client, f"reading the holders of manifest {manifest_id}"):
                ids = await members(self.client, self.keys.chunk_holders(manifest_id))
            # Only those with a lease: a dead node's entry is skipped.
            reports = await self.registry.reports(sorted(ids - {self.node_id}))
        except ClusterUnavailable as error:
            log.warning("restoring %s without peers: %s", manifest_id, error)
            return []
        peers = []
        for node_id, report in reports.items():
            address = NodeAddress.of(report.address)
            host = f"[{address.host}]" if ":" in address.host else address.host
            url = f"http://{host}:{address.port}{_CHUNKS}"
            peers.append(Peer(node_id, url, self._headers))
        random.shuffle(peers)
        return peers

    async def holding(self, manifest_id: str) -> None:
        key = self.keys.chunk_holders(manifest_id)
        try:
            async with guarded(self.client, f"recording node {self.node_id} holds {manifest_id}"):
                await self.client.sadd(key, self.node_id)
        except ClusterUnavailable as error:
            log.warning("peers will not learn this node holds %s: %s", manifest_id, error)

    async def dropped(self, manifest_id: str) -> None:
        try:
            async with guarded(self.client, f"dropping the holders of {manifest_id}"):
                await self.client.delete(self.keys.chunk_holders(manifest_id))
        except ClusterUnavailable as error:
            log.warning("holders of the deleted manifest %s stay: %s", manifest_id, error)
