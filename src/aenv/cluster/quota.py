"""Each API key's sandboxes at once, and each team's, counted across the cluster
(`key_max_sandboxes`, `team_max_sandboxes`).

Nodes are the truth: each node's agent writes, per key, the ids of the key's running sandboxes
it holds (`{aenv}:node-keys:<node>`, a hash that expires with the node's lease), with every
heartbeat and at once when a sandbox is created or killed there (the orchestrator's residency
events, inside the call). A create through a gateway first reserves a slot
(`{aenv}:key-creates:<key>`: token -> when the reservation lapses): one script drops the lapsed
reservations, counts the rest and the key's sandboxes on every node with a lease, and adds the
reservation only below the limit, so gateways creating for one key at once never pass it
together. The reservation is dropped once the node answered: by then the node has written the
new sandbox (its residency event), or the create did not happen.

A node lost takes its count with it (its hash expires, and a node without a lease is skipped);
a wiped Redis is written again by every node's next heartbeat. A pause, a timeout or a resume
changes a node's count at its next heartbeat (a pause may be refused meanwhile, never a create
let past the limit by a pause; a resume counts late).

A team is counted as a key is, under its own name (`team_owner`: `team/<id>`, which no key id
can be): nodes write its running sandboxes beside their keys', and a create reserves a slot of
its team as of its key.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Set

import redis.asyncio as aioredis
from redis.typing import EncodableT

from aenv.cluster.store import Keys, guarded
from aenv.cluster.team_limits import disk_field

# A create through a gateway holds its slot at most this long if the gateway dies meanwhile.
RESERVATION_TTL_S = 300.0

# KEYS: the key's reservations, the node ids. ARGV: node-keys prefix, lease prefix, key id,
# limit, token, reservation ms. Returns -1 when it reserved, else the count that refuses it.
_RESERVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local held = 0
local reserved = redis.call('HGETALL', KEYS[1])
for i = 1, #reserved, 2 do
  if tonumber(reserved[i + 1]) < now then
    redis.call('HDEL', KEYS[1], reserved[i])
  else
    held = held + 1
  end
end
for _, node in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  if redis.call('EXISTS', ARGV[2] .. node) == 1 then
    local ids = redis.call('HGET', ARGV[1] .. node, ARGV[3])
    if ids then
      for _ in string.gmatch(ids, '%S+') do held = held + 1 end
    end
  end
end
if held >= tonumber(ARGV[4]) then return held end
redis.call('HSET', KEYS[1], ARGV[5], now + tonumber(ARGV[6]))
return -1
"""


def team_owner(team_id: str) -> str:
    """The name a team's sandboxes are counted under, beside the keys'."""
    return f"team/{team_id}"


class KeyLimitReached(Exception):
    """The key holds its limit of sandboxes at once; the message is E2B's."""


class KeyQuota:
    def __init__(self, client: aioredis.Redis, keys: Keys | None = None) -> None:
        self.client = client
        self.keys = keys or Keys()
        self._reserve = client.register_script(_RESERVE)

    async def reserve(self, key_id: str, limit: int, holder: str = "this API key") -> str:
        """A slot for one create of the key (or team: `team_owner`): the reservation's token.
        Raises `KeyLimitReached`, saying `holder` holds the limit; `ClusterUnavailable`."""
        token = secrets.token_hex(8)
        keys = [self.keys.key_creates(key_id), self.keys.nodes]
        args: list[str | int] = [
            self.keys.node_keys(""),
            self.keys.lease(""),
            key_id,
            limit,
            token,
            int(RESERVATION_TTL_S * 1000),
        ]
        async with guarded(self.client, f"reserving a sandbox of API key {key_id}"):
            held = int(await self._reserve(keys, args))
        if held >= 0:
            # E2B's words, so that clients matching them keep working.
            raise KeyLimitReached(
                f"you have reached the maximum number of concurrent E2B sandboxes ({limit}): "
                f"{holder} holds {held} across the cluster"
            )
        return token

    async def release(self, key_id: str, token: str) -> None:
        """The reservation's create is over (its sandbox, if any, counts on its node now)."""
        async with guarded(self.client, f"releasing a reservation of API key {key_id}"):
            await self.client.hdel(self.keys.key_creates(key_id), token)

    async def publish(
        self,
        node_id: str,
        running: Mapping[str, Set[str]],
        ttl: float,
        disk: Mapping[str, int] | None = None,
    ) -> None:
        """Makes the node's count exactly `running` (key id -> its running sandbox ids here)
        and `disk` (team id -> MiB its sandboxes and volumes take here, `team_limits`),
        expiring with the node's lease (`ttl` seconds)."""
        name = self.keys.node_keys(node_id)
        counted: dict[EncodableT, EncodableT] = {
            key: " ".join(sorted(ids)) for key, ids in running.items() if ids
        }
        counted.update({disk_field(team): mb for team, mb in (disk or {}).items() if mb})
        doing = f"counting the sandboxes of node {node_id} per API key"
        async with guarded(self.client, doing), self.client.pipeline(transaction=True) as pipe:
            pipe.delete(name)
            if counted:
                pipe.hset(name, mapping=counted)
                pipe.pexpire(name, int(ttl * 1000))
            await pipe.execute()
