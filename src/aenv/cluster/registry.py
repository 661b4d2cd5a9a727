"""The node registry: a node holds its id through a lease it renews with every heartbeat, and
reports its capacity and cached files with it; a node whose lease lapsed is gone.

A lease is two keys with the same TTL: the owning process's instance token and the node's last
report. One script checks the token and renews both, so two processes can never hold one id: the
second is refused until the first's lease lapses.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from pydantic import TypeAdapter

from aenv.api.internal_models import REPLAY
from aenv.cluster.node_events import NodeEventType, xadd
from aenv.cluster.secret import ClusterSecret
from aenv.cluster.store import Keys, guarded, members

# KEYS: lease, node, nodes, epoch, secret, node events. ARGV: token, report, ttl ms, node id,
# candidate epoch, secret fingerprint, now. Returns {1, epoch, 1 if the lease was taken anew
# (none was held)} when renewed, {0, other token} when another process holds the id, {-1, ''}
# when the cluster was formed with another secret. A lease taken anew is the node back; one
# whose id was still listed had lapsed unreleased, unnoticed: its failure is recorded first.
_HEARTBEAT = f"""
local check = redis.call('GET', KEYS[5])
if check and check ~= ARGV[6] then return {{-1, ''}} end
local owner = redis.call('GET', KEYS[1])
if owner and owner ~= ARGV[1] then return {{0, owner}} end
if not owner then
  if redis.call('SISMEMBER', KEYS[3], ARGV[4]) == 1 then
    {xadd("KEYS[6]", NodeEventType.FAILED, "ARGV[4]", "ARGV[7]")}
  end
  {xadd("KEYS[6]", NodeEventType.BACK, "ARGV[4]", "ARGV[7]")}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
redis.call('SADD', KEYS[3], ARGV[4])
redis.call('SET', KEYS[4], ARGV[5], 'NX')
redis.call('SET', KEYS[5], ARGV[6], 'NX')
return {{1, redis.call('GET', KEYS[4]), owner and 0 or 1}}
"""

# KEYS: lease, node. ARGV: token, report. Rewrites the report within the current lease, for its
# holder only (a lapsed or taken lease waits for the next heartbeat).
_REFRESH = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[2], 'KEEPTTL')
return 1
"""

# KEYS: lease, node, nodes. ARGV: token, node id. Releases the id only for its holder.
_RELEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('SREM', KEYS[3], ARGV[2])
return 1
"""


# KEYS: nodes, node events. ARGV: node key prefix, now, then node ids. Drops the ids whose
# lease is (still) gone, so a node that registered again since the caller looked stays listed;
# the one caller that drops an id records its failure.
_FORGET = f"""
for i = 3, #ARGV do
  if redis.call('EXISTS', ARGV[1] .. ARGV[i]) == 0 and redis.call('SREM', KEYS[1], ARGV[i]) == 1
  then
    {xadd("KEYS[2]", NodeEventType.FAILED, "ARGV[i]", "ARGV[2]")}
  end
end
return 1
"""


class NodeIdTaken(Exception):
    """Another live process holds this node id; nothing was written."""


class WrongClusterSecret(Exception):
    """The cluster was formed with another secret; nothing was written."""


@dataclass(frozen=True)
class Capacity:
    """What a node has and how much of it is in use, as of its last heartbeat."""

    cpus: int
    memory_mb: int
    memory_free_mb: int
    running: int
    paused: int


@dataclass(frozen=True)
class NodeReport:
    """One heartbeat's content: where the node is reached, its capacity, the template and
    snapshot ids whose files it holds, and the versions of the internal API it serves
    (`aenv.api.internal_models`; a node of a release before version 1 names none: it serves
    version 0 only)."""

    node_id: str
    address: str
    capacity: Capacity
    templates: Sequence[str] = ()
    snapshots: Sequence[str] = ()
    reported_at: float = field(default_factory=time.time)
    internal_versions: tuple[int, ...] = (REPLAY,)


_REPORT = TypeAdapter(NodeReport)


@dataclass(frozen=True)
class Lease:
    """A renewed lease, with the epoch of the Redis data set it was renewed in."""

    node_id: str
    epoch: str
    # No lease was held before this heartbeat: the node's first, or one after its lease lapsed
    # (cut off, or paused too long), while gateways may have dropped its routes.
    fresh: bool = False


class NodeRegistry:
    """Registration, heartbeats and the list of live nodes."""

    def __init__(
        self, client: aioredis.Redis, secret: ClusterSecret, keys: Keys | None = None
    ) -> None:
        self.client = client
        self.secret = secret
        self.keys = keys or Keys()
        self._heartbeat = client.register_script(_HEARTBEAT)
        self._release = client.register_script(_RELEASE)
        self._refresh = client.register_script(_REFRESH)
        self._forget = client.register_script(_FORGET)

    async def heartbeat(self, token: str, report: NodeReport, ttl: float) -> Lease:
        """Registers the node or renews its lease for `ttl` seconds with `report`.

        `token` names the calling process; raises `NodeIdTaken` if another token holds the id,
        `WrongClusterSecret` if the cluster has another secret, `ClusterUnavailable` if Redis
        does not answer.
        """
        k, node_id = self.keys, report.node_id
        keys = [k.lease(node_id), k.node(node_id), k.nodes, k.epoch, k.secret, k.node_events]
        args: list[str | int] = [
            token,
            _REPORT.dump_json(report).decode(),
            int(ttl * 1000),
            node_id,
        ]
        async with guarded(self.client, f"renewing the lease of node {node_id}"):
            renewed, value, *fresh = await self._heartbeat(
                keys, [*args, secrets.token_hex(16), self.secret.fingerprint, repr(time.time())]
            )
        if renewed == -1:
            raise WrongClusterSecret(
                f"node {node_id} refused: its cluster secret differs from the one this cluster's "
                "nodes registered with (check AENV_CLUSTER_SECRET)"
            )
        if not renewed:
            raise NodeIdTaken(f"node id {node_id} is held by another live process ({value})")
        return Lease(node_id, str(value), fresh == [1])

    async def refresh(self, token: str, report: NodeReport) -> bool:
        """Writes `report` now, between heartbeats, if `token` holds the lease; True if it did.
        A create's new sandbox is counted at once so (`aenv.cluster.creating`)."""
        keys = [self.keys.lease(report.node_id), self.keys.node(report.node_id)]
        async with guarded(self.client, f"updating the report of node {report.node_id}"):
            return bool(await self._refresh(keys, [token, _REPORT.dump_json(report).decode()]))

    async def release(self, token: str, node_id: str) -> bool:
        """Gives the id up at shutdown (only if `token` holds it); True if it did."""
        keys = [self.keys.lease(node_id), self.keys.node(node_id), self.keys.nodes]
        async with guarded(self.client, f"releasing node {node_id}"):
            return bool(await self._release(keys, [token, node_id]))

    async def live(self) -> list[NodeReport]:
        """Every node whose lease is current, ordered by id."""
        async with guarded(self.client, "listing nodes"):
            ids = sorted(await members(self.client, self.keys.nodes))
            if not ids:
                return []
            values = await self.client.mget([self.keys.node(i) for i in ids])
            lapsed = [i for i, v in zip(ids, values, strict=True) if v is None]
            if lapsed:
                # Cleanup only: a lapsed id in the set is harmless, the lease key decides.
                await self._forget(
                    [self.keys.nodes, self.keys.node_events],
                    [self.keys.node(""), repr(time.time()), *lapsed],
                )
        return [_REPORT.validate_json(v) for v in values if v is not None]

    async def report(self, node_id: str) -> NodeReport | None:
        """The node's last report while its lease is current, else None."""
        async with guarded(self.client, f"reading the report of node {node_id}"):
            value = await self.client.get(self.keys.node(node_id))
        return None if value is None else _REPORT.validate_json(value)

    async def reports(self, node_ids: Sequence[str]) -> dict[str, NodeReport]:
        """The last reports of those of `node_ids` whose lease is current."""
        if not node_ids:
            return {}
        async with guarded(self.client, "reading node reports"):
            values = await self.client.mget([self.keys.node(i) for i in node_ids])
        return {
            i: _REPORT.validate_json(v)
            for i, v in zip(node_ids, values, strict=True)
            if v is not None
        }

    async def lease_left(self, node_id: str) -> float | None:
        """Seconds until the node's lease lapses unless renewed; None when it has lapsed."""
        async with guarded(self.client, f"reading the lease of node {node_id}"):
            left = int(await self.client.pttl(self.keys.lease(node_id)))
        return None if left < 0 else left / 1000

    async def alive(self, node_ids: Sequence[str]) -> set[str]:
        """Which of `node_ids` hold a current lease."""
        if not node_ids:
            return set()
        async with guarded(self.client, "checking node leases"):
            values = await self.client.mget([self.keys.lease(i) for i in node_ids])
        return {i for i, v in zip(node_ids, values, strict=True) if v is not None}
