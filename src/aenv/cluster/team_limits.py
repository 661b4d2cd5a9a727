"""A team's creates a second and its disk, counted across the cluster's gateways
(`team_creates_per_s`, `team_max_disk_mb`), as `quota` counts its sandboxes at once.

- **Creates a second**: one token bucket per team in Redis (`Keys.team_rate`), refilled and
  spent by one script on Redis's clock, so every gateway draws from the same bucket. A create
  that may wait (`X-Aenv-Wait`) takes the next token ahead, up to its wait, and is held until
  then, as a key's requests are (`api.limits`): a burst is spread at the team's rate instead
  of partly refused. The bucket goes below zero by the tokens promised, so later creates queue
  behind them. A create that may not wait, or whose turn is further than its wait, is E2B's
  429 with `Retry-After`.
- **Disk**: each node writes, beside its running sandboxes per key (`quota.publish`), the disk
  each team's sandboxes (paused ones too, at their full disk size) and sized volumes take
  there, under `disk/<team>` (`disk_field`), at every heartbeat and at once on a create or a
  kill. A create through a gateway reserves its disk (`Keys.team_disk`: token -> lapse and
  MiB) in one script that sums the team's disk on every node with a lease and the
  reservations not lapsed, and adds its own only within the limit; it is dropped once the
  node answered, when the node has written the sandbox's disk. A lost node's count goes with
  its lease (its paused sandboxes count again once moved to a live node).
"""

from __future__ import annotations

import math
import secrets

import redis.asyncio as aioredis

from aenv.cluster.store import Keys, guarded

# A create through a gateway holds its disk at most this long if the gateway dies meanwhile.
RESERVATION_TTL_S = 300.0

# KEYS: the team's bucket. ARGV: rate (tokens a second), burst, wait (s) the create may be held.
# Returns {granted (1/0), seconds: to hold it when granted, else until one would be granted}.
_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate, burst, wait = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local held = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens, at = tonumber(held[1]) or burst, tonumber(held[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - at) * rate)
local ahead = math.max(0, (1 - tokens) / rate)
if ahead > wait then return {0, tostring(ahead)} end
tokens = tokens - 1
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil((burst - tokens) / rate * 1000) + 1000)
return {1, tostring(ahead)}
"""

# KEYS: the team's reservations, the node ids. ARGV: node-keys prefix, lease prefix, the team's
# disk field, limit (MiB), token, reservation ms, MiB wanted. Returns -1 when it reserved, else
# the MiB the team holds, which refuses it.
_RESERVE_DISK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local held = 0
local reserved = redis.call('HGETALL', KEYS[1])
for i = 1, #reserved, 2 do
  local lapse, mb = string.match(reserved[i + 1], '(%d+) (%d+)')
  if tonumber(lapse) < now then
    redis.call('HDEL', KEYS[1], reserved[i])
  else
    held = held + tonumber(mb)
  end
end
for _, node in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  if redis.call('EXISTS', ARGV[2] .. node) == 1 then
    held = held + (tonumber(redis.call('HGET', ARGV[1] .. node, ARGV[3])) or 0)
  end
end
if held + tonumber(ARGV[7]) > tonumber(ARGV[4]) then return held end
redis.call('HSET', KEYS[1], ARGV[5], (now + tonumber(ARGV[6])) .. ' ' .. ARGV[7])
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[6]) then
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[6]))
end
return -1
"""

# KEYS: the team's reservations. ARGV: token, ms it is kept from now. Keeps the reservation's
# MiB until then, if it is still held.
_KEEP_DISK = """
local held = redis.call('HGET', KEYS[1], ARGV[1])
if not held then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local mb = string.match(held, '%d+ (%d+)')
redis.call('HSET', KEYS[1], ARGV[1], (now + tonumber(ARGV[2])) .. ' ' .. mb)
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
end
return 1
"""


def disk_field(team_id: str) -> str:
    """The field of a node's count (`Keys.node_keys`) holding a team's disk there, MiB; no key
    id or team count (`quota.team_owner`) has that shape."""
    return f"disk/{team_id}"


class TeamRateReached(Exception):
    """The team started its creates of this second; `retry_in`: seconds until one would go."""

    def __init__(self, rate: float, retry_in: float) -> None:
        super().__init__(f"Rate limit exceeded: at most {rate:g} sandbox creates a second per team")
        self.retry_in = retry_in


class TeamDiskReached(Exception):
    """One more create would take the team past its disk; the message says by how much."""


class TeamLimits:
    """Every method raises `ClusterUnavailable` while Redis does not answer."""

    def __init__(self, client: aioredis.Redis, keys: Keys | None = None) -> None:
        self.client = client
        self.keys = keys or Keys()
        self._take = client.register_script(_TAKE)
        self._reserve_disk = client.register_script(_RESERVE_DISK)
        self._keep_disk = client.register_script(_KEEP_DISK)

    async def take_create(self, team_id: str, rate: float, wait: float = 0.0) -> float:
        """Spends one of the team's creates of this second (a burst of `ceil(rate)`), which
        may be held up to `wait` seconds: the seconds to hold it (0: go now). Raises
        `TeamRateReached` (nothing spent)."""
        burst = max(1, math.ceil(rate))
        async with guarded(self.client, f"counting the creates of team {team_id}"):
            granted, seconds = await self._take(
                [self.keys.team_rate(team_id)], [repr(rate), burst, repr(max(0.0, wait))]
            )
        if not int(granted):
            raise TeamRateReached(rate, float(seconds))
        return float(seconds)

    async def reserve_disk(self, team_id: str, need_mb: int, limit_mb: int) -> str:
        """Holds `need_mb` of the team's disk for one create: the reservation's token. Raises
        `TeamDiskReached` when the team's sandboxes and volumes on every node, with the
        creates under way, leave less than that below `limit_mb`."""
        token = secrets.token_hex(8)
        keys = [self.keys.team_disk(team_id), self.keys.nodes]
        args: list[str | int] = [
            self.keys.node_keys(""),
            self.keys.lease(""),
            disk_field(team_id),
            limit_mb,
            token,
            int(RESERVATION_TTL_S * 1000),
            max(0, need_mb),
        ]
        async with guarded(self.client, f"reserving disk of team {team_id}"):
            held = int(await self._reserve_disk(keys, args))
        if held >= 0:
            raise TeamDiskReached(
                f"this team's sandboxes and volumes hold {held} MiB of disk across the cluster;"
                f" {need_mb} MiB more would pass its limit of {limit_mb} MiB"
            )
        return token

    async def release_disk(self, team_id: str, token: str) -> None:
        """The reservation's create is over (its sandbox, if any, counts on its node now)."""
        async with guarded(self.client, f"releasing disk of team {team_id}"):
            await self.client.hdel(self.keys.team_disk(team_id), token)

    async def keep_disk(self, team_id: str, token: str, seconds: float) -> None:
        """The reservation's create is over, but its disk is counted by its node only later
        (a volume's, at the node's next heartbeat): keep it `seconds` more."""
        async with guarded(self.client, f"keeping disk of team {team_id}"):
            await self._keep_disk([self.keys.team_disk(team_id)], [token, int(seconds * 1000)])
