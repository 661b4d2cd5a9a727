"""A gateway's read side of the cluster state: which live node a sandbox is on, which nodes are
live, which hold a template's files, which snapshots any node can start from, and whether the
gateway's secret is the cluster's.

Placement counts the creates under way on each node too (`creating`).

A node counts only while its lease is current: its report expires with the lease, so a sandbox
routed to a node that stopped heartbeating is not found, never proxied to a dead address.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import redis.asyncio as aioredis

from aenv.cluster.builds import BuildPlaces
from aenv.cluster.creating import Creating
from aenv.cluster.drain import Drains
from aenv.cluster.holders import FileKind, FileRef, Holders
from aenv.cluster.node_events import NodeEvents
from aenv.cluster.parked import Parked
from aenv.cluster.quota import KeyQuota
from aenv.cluster.registry import NodeRegistry, NodeReport, WrongClusterSecret
from aenv.cluster.routing import Routes
from aenv.cluster.saved import SavedRecords
from aenv.cluster.secret import ClusterSecret
from aenv.cluster.store import guarded
from aenv.cluster.volumes import VolumePlaces


@dataclass(frozen=True)
class NodeAddress:
    host: str
    port: int

    @classmethod
    def of(cls, address: str) -> NodeAddress:
        """`host:port` (`[v6]:port` too), as a node reports it."""
        host, _, port = address.rpartition(":")
        return cls(host.strip("[]"), int(port))


class Directory:
    def __init__(self, client: aioredis.Redis, secret: ClusterSecret) -> None:
        self.client = client
        self.secret = secret
        self.registry = NodeRegistry(client, secret)
        self.routes = Routes(client, self.registry.keys)
        self.holders = Holders(self.registry)
        self.parked = Parked(client, secret, self.registry.keys)
        self.saved = SavedRecords(client, self.registry.keys)
        self.drains = Drains(client, self.registry.keys)
        self.node_events = NodeEvents(client, self.registry.keys)
        self.builds = BuildPlaces(client, self.registry.keys)
        self.volumes = VolumePlaces(client, self.registry.keys)
        self.quota = KeyQuota(client, self.registry.keys)
        self.creating = Creating(client, self.registry.keys)

    async def node_of(self, sandbox_id: str) -> NodeReport | None:
        """The live node the sandbox is routed to, or None (no route, or its node's lease
        lapsed). Raises `ClusterUnavailable`."""
        node_id = await self.routes.lookup(sandbox_id)
        if node_id is None:
            return None
        return await self.registry.report(node_id)

    async def unroute_lost(self, sandbox_id: str) -> bool:
        """Drops the sandbox's route if it points at a node whose lease is gone; True if it
        did. Call it only once the sandbox is known not to be parked: it is lost then."""
        node_id = await self.routes.lookup(sandbox_id)
        return node_id is not None and await self.routes.clear_lost(sandbox_id, node_id)

    async def live(self) -> list[NodeReport]:
        return await self.registry.live()

    async def placeable(self) -> list[NodeReport]:
        """The live nodes that take new sandboxes (not draining), each with the creates under
        way on it counted as running (`aenv.cluster.creating`)."""
        draining = await self.drains.draining()
        nodes = [n for n in await self.registry.live() if n.node_id not in draining]
        creating = await self.creating.counts([n.node_id for n in nodes])
        return [_with_running(n, creating[n.node_id]) for n in nodes]

    async def template_holders(self, template_id: str) -> set[str]:
        return await self.holders.of(FileRef(FileKind.TEMPLATE, template_id))

    async def file_holders(self, template_id: str) -> set[str]:
        """The nodes holding the files of a template or snapshot of this id."""
        snapshot = await self.holders.of(FileRef(FileKind.SNAPSHOT, template_id))
        return await self.template_holders(template_id) | snapshot

    async def check_secret(self) -> None:
        """Raises `WrongClusterSecret` when the cluster's nodes registered with another secret
        (nothing registered yet passes), `ClusterUnavailable` when Redis does not answer."""
        async with guarded(self.client, "checking the cluster secret"):
            recorded = await self.client.get(self.registry.keys.secret)
        if recorded is not None and recorded != self.secret.fingerprint:
            raise WrongClusterSecret(
                "this gateway's cluster secret differs from the one the cluster's nodes "
                "registered with (check AENV_CLUSTER_SECRET)"
            )


def _with_running(node: NodeReport, more: int) -> NodeReport:
    if not more:
        return node
    capacity = dataclasses.replace(node.capacity, running=node.capacity.running + more)
    return dataclasses.replace(node, capacity=capacity)
