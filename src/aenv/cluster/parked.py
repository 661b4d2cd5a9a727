"""Paused sandboxes any node can resume: their records, published beside the routes, whose
checkpoints are in the cluster's shared snapshot repository.

A node publishes each of its paused sandboxes whose newest checkpoint reached the repository (its
agent, every heartbeat), and withdraws it when that stops being so; a sandbox released for a
drain is published by nobody (`released`), so no node withdraws it. When a sandbox's node is gone
or gave it up, a gateway claims the move (`claim`: one gateway at a time), has another node adopt
the record, and removes it here (`remove`): the adopting node holds the truth from then on.
Each publisher's records are indexed (`Keys.parked_by`, `lost`), so a gateway finds the paused
sandboxes of a lost node without scanning every key.

A record holds what a sandbox was created with, its egress proxy's password and its header
rules' values among it: it is sealed under the cluster's key (`aenv.cluster.sealed`), bound
to the sandbox's id, so reading Redis shows none of it. A record in plain JSON, as a node of
the release before this one published it, is still read (a rolling upgrade), and sealed when
its node republishes it after its own upgrade.
"""

from __future__ import annotations

from collections.abc import Awaitable, Set
from dataclasses import dataclass
from typing import cast

import redis.asyncio as aioredis

from aenv.cluster.sealed import PREFIX, Sealer
from aenv.cluster.secret import ClusterSecret
from aenv.cluster.store import Keys, guarded, members

# KEYS: the parked hash, the node's parked-by set. ARGV: node id, sandbox id. Only the
# publishing node's own entry goes.
_WITHDRAW = """
if redis.call('HGET', KEYS[1], 'node') ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[2])
return 1
"""


# KEYS: the parked hash, the node's parked-by set, the parked-nodes set. ARGV: node id, record,
# sandbox id. A released record (no publisher) is left alone: its node gave it up, and a
# heartbeat that read the node's catalog before must not take it back.
_PUBLISH = """
if redis.call('HGET', KEYS[1], 'node') == '' then return 0 end
redis.call('HSET', KEYS[1], 'node', ARGV[1], 'record', ARGV[2])
redis.call('SADD', KEYS[2], ARGV[3])
redis.call('SADD', KEYS[3], ARGV[1])
return 1
"""

# KEYS: the parked hash, the parked-by key prefix. ARGV: sandbox id.
_REMOVE = """
local node = redis.call('HGET', KEYS[1], 'node')
redis.call('DEL', KEYS[1])
if node then redis.call('SREM', KEYS[2] .. node, ARGV[1]) end
return 1
"""


@dataclass(frozen=True)
class ParkedSandbox:
    sandbox_id: str
    node_id: str  # who published it; "" once released
    record: str  # `aenv.orchestrator.catalog.record_to_json`, opened


def _context(sandbox_id: str) -> str:
    return f"parked {sandbox_id}"


class Parked:
    def __init__(
        self, client: aioredis.Redis, secret: ClusterSecret, keys: Keys | None = None
    ) -> None:
        self.client = client
        self.keys = keys or Keys()
        self._sealer = Sealer(secret)
        self._withdraw = client.register_script(_WITHDRAW)
        self._publish = client.register_script(_PUBLISH)
        self._remove = client.register_script(_REMOVE)

    async def publish(self, node_id: str, sandbox_id: str, record: str) -> bool:
        """Publishes the record as `node_id`'s unless it was released; True if it did."""
        async with guarded(self.client, f"publishing paused sandbox {sandbox_id}"):
            keys = [
                self.keys.parked(sandbox_id),
                self.keys.parked_by(node_id),
                self.keys.parked_nodes,
            ]
            sealed = self._sealer.seal(record, _context(sandbox_id))
            return bool(await self._publish(keys, [node_id, sealed, sandbox_id]))

    async def released(self, sandbox_id: str, record: str) -> None:
        """A record its node gave up (a drain): no node withdraws it, an adopter removes it."""
        doing = f"publishing released sandbox {sandbox_id}"
        async with guarded(self.client, doing):
            key = self.keys.parked(sandbox_id)
            before = await cast("Awaitable[str | None]", self.client.hget(key, "node"))
        async with guarded(self.client, doing), self.client.pipeline(transaction=True) as pipe:
            if before:  # published by its node until now
                pipe.srem(self.keys.parked_by(before), sandbox_id)
            sealed = self._sealer.seal(record, _context(sandbox_id))
            pipe.hset(self.keys.parked(sandbox_id), mapping={"node": "", "record": sealed})
            pipe.sadd(self.keys.parked_by(""), sandbox_id)
            pipe.sadd(self.keys.parked_nodes, "")
            await pipe.execute()

    async def withdraw(self, node_id: str, sandbox_id: str) -> bool:
        """Removes the record if `node_id` published it; True if it did."""
        async with guarded(self.client, f"withdrawing paused sandbox {sandbox_id}"):
            keys = [self.keys.parked(sandbox_id), self.keys.parked_by(node_id)]
            return bool(await self._withdraw(keys, [node_id, sandbox_id]))

    async def get(self, sandbox_id: str) -> ParkedSandbox | None:
        """The sandbox's record, opened. Raises `aenv.cluster.sealed.Unsealable` for one
        sealed under another cluster secret (or altered)."""
        async with guarded(self.client, f"reading paused sandbox {sandbox_id}"):
            key = self.keys.parked(sandbox_id)
            fields = await cast("Awaitable[dict[str, str]]", self.client.hgetall(key))
        if "record" not in fields:
            return None
        record = fields["record"]
        if record.startswith(PREFIX):
            record = self._sealer.open(record, _context(sandbox_id))
        return ParkedSandbox(sandbox_id, fields.get("node", ""), record)

    async def remove(self, sandbox_id: str) -> None:
        async with guarded(self.client, f"removing paused sandbox {sandbox_id}"):
            # The script names the publisher's set: the prefix and the publisher read there.
            keys = [self.keys.parked(sandbox_id), self.keys.parked_by("")]
            await self._remove(keys, [sandbox_id])

    async def lost(self, live: Set[str]) -> set[str]:
        """The ids of parked sandboxes whose publisher is not in `live` (released ones too)."""
        async with guarded(self.client, "finding the paused sandboxes of lost nodes"):
            publishers = await members(self.client, self.keys.parked_nodes)
            found: set[str] = set()
            # Node ids stay in the index (a few bytes each): removing one could race its
            # next publication.
            for node_id in publishers - live:
                found |= await members(self.client, self.keys.parked_by(node_id))
        return found

    async def claim(self, sandbox_id: str, who: str, ttl: float) -> bool:
        """Whether `who` may move the sandbox now; the claim lapses after `ttl` seconds."""
        async with guarded(self.client, f"claiming the move of sandbox {sandbox_id}"):
            key = self.keys.moving(sandbox_id)
            return bool(await self.client.set(key, who, nx=True, px=int(ttl * 1000)))

    async def unclaim(self, sandbox_id: str) -> None:
        async with guarded(self.client, f"ending the move of sandbox {sandbox_id}"):
            await self.client.delete(self.keys.moving(sandbox_id))
