"""The cluster's API keys, in Redis, so that a key made through one gateway works through every
gateway and a key revoked through one stops working on all of them at once.

A key is stored as a node stores it (`aenv.api.keys.ApiKey`: the SHA-256 of its value, never the
value), in a hash by digest, so a request's key is checked with one `HGET` of its digest. A key's
value carries 160 random bits, so a lookup by its digest reveals nothing a timing could use.
When a key was last used goes in a hash of its own, written by each gateway at most once a minute
per key. Renames and revokes are scripts, so no key is ever half removed and the cluster's last
key stays.

Keys are the one part of the cluster's state the nodes cannot rebuild, so each gateway keeps a
copy in its home (`sync_keys`, every few seconds) and gives it back to a Redis found without
keys (wiped, or restarted without persistence); the first gateway of a new cluster generates its
first key.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import cast

import redis.asyncio as aioredis

from aenv.api.keys import LAST_USED_PERSIST_S, ApiKey, KeyStore, LastKey, digest, write_key_file
from aenv.cluster.store import Keys, guarded
from aenv.config import Paths
from aenv.ids import TEAM_ID, new_api_key

# KEYS: keys by digest, ids. ARGV: "1" to add only into an empty set, then per key its digest,
# id and record. Returns 1 when it added them.
_ADD = """
if ARGV[1] == '1' and redis.call('HLEN', KEYS[1]) > 0 then return 0 end
for i = 2, #ARGV, 3 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 2])
  redis.call('HSET', KEYS[2], ARGV[i + 1], ARGV[i])
end
return 1
"""

# KEYS: keys by digest, ids. ARGV: id, digest, the renamed record. A key revoked meanwhile stays
# revoked.
_RENAME = """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
return 1
"""

# KEYS: keys by digest, ids, last used. ARGV: id. Returns -1 for an unknown id, 0 for the last.
_REVOKE = """
local found = redis.call('HGET', KEYS[2], ARGV[1])
if not found then return -1 end
if redis.call('HLEN', KEYS[1]) <= 1 then return 0 end
redis.call('HDEL', KEYS[1], found)
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return 1
"""


class ClusterKeys:
    """A `KeyBook` in the cluster's Redis. Every method raises `ClusterUnavailable` while Redis
    does not answer."""

    def __init__(self, client: aioredis.Redis, keys: Keys | None = None) -> None:
        self.client = client
        self.names = keys or Keys()
        self._add = client.register_script(_ADD)
        self._rename = client.register_script(_RENAME)
        self._revoke = client.register_script(_REVOKE)
        self._persisted_use: dict[str, float] = {}

    async def find(self, given: str | None) -> ApiKey | None:
        if not given:
            return None
        async with guarded(self.client, "checking an API key"):
            stored = await self._hget(self.names.api_keys, digest(given.strip()))
            if stored is None:
                return None
            key = _key(stored)
            now = time.time()
            if now - self._persisted_use.get(key.id, 0.0) >= LAST_USED_PERSIST_S:
                await self.client.hset(self.names.api_key_used, key.id, repr(now))
                self._persisted_use[key.id] = now
        return dataclasses.replace(key, last_used=now)

    async def keys(self) -> list[ApiKey]:
        async with guarded(self.client, "listing API keys"):
            stored = await self._hgetall(self.names.api_keys)
            used = await self._hgetall(self.names.api_key_used)
        found = [_key(record) for record in stored.values()]
        found = [dataclasses.replace(k, last_used=_float(used.get(k.id))) for k in found]
        return sorted(found, key=lambda k: (k.created_at, k.id))

    async def new(self, name: str, team_id: str = TEAM_ID) -> tuple[ApiKey, str]:
        value = new_api_key()
        key = ApiKey.of(value, name, team_id)
        await self.seed([key], only_if_empty=False)
        return key, value

    async def seed(self, keys: list[ApiKey], only_if_empty: bool = True) -> bool:
        """Adds `keys`; with `only_if_empty`, only into a cluster without keys. True if added."""
        args = ["1" if only_if_empty else "0"]
        for key in keys:
            args += [key.digest, key.id, _record(key)]
        async with guarded(self.client, "adding API keys"):
            added = await self._add([self.names.api_keys, self.names.api_key_ids], args)
        return bool(added)

    async def rename(self, key_id: str, name: str) -> ApiKey:
        async with guarded(self.client, f"renaming API key {key_id}"):
            found = await self._hget(self.names.api_key_ids, key_id)
            stored = None if found is None else await self._hget(self.names.api_keys, found)
            if found is None or stored is None:
                raise KeyError(key_id)
            renamed = dataclasses.replace(_key(stored), name=name)
            names = [self.names.api_keys, self.names.api_key_ids]
            if not await self._rename(names, [key_id, found, _record(renamed)]):
                raise KeyError(key_id)
        return renamed

    async def revoke(self, key_id: str) -> None:
        names = [self.names.api_keys, self.names.api_key_ids, self.names.api_key_used]
        async with guarded(self.client, f"revoking API key {key_id}"):
            done = await self._revoke(names, [key_id])
        if done == -1:
            raise KeyError(key_id)
        if done == 0:
            raise LastKey("cannot revoke the cluster's last API key: create another one first")

    async def _hget(self, name: str, field: str) -> str | None:
        return await cast("Awaitable[str | None]", self.client.hget(name, field))

    async def _hgetall(self, name: str) -> dict[str, str]:
        return await cast("Awaitable[dict[str, str]]", self.client.hgetall(name))


async def sync_keys(book: ClusterKeys, paths: Paths) -> bool:
    """Keeps this gateway's copy of the cluster's keys (`paths.api_keys`) and gives a cluster
    without keys (a new one, or a Redis wiped) that copy back, with the operator's key in
    `paths.api_key` (a key file a deployment mounts, or the one a gateway generated); with
    neither, a new key whose value goes there (0600), as `aenv server` does. True when it made
    a key. Raises `ClusterUnavailable`."""
    copy = KeyStore(paths.api_keys)
    # Without when each was last used: the copy changes only with the keys.
    current = [dataclasses.replace(key, last_used=None) for key in await book.keys()]
    if current:
        if current != copy.list():
            copy.replace(current)
        return False
    given = _read(paths.api_key)
    kept = copy.list()
    if given and all(key.digest != digest(given) for key in kept):
        kept.append(ApiKey.of(given, "default"))
    value = None if kept else new_api_key()
    seeded = await book.seed(kept if value is None else [ApiKey.of(value, "default")])
    if seeded and value is not None:
        write_key_file(paths.api_key, value)
        return True
    return False


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return ""


def _record(key: ApiKey) -> str:
    fields = dataclasses.asdict(dataclasses.replace(key, last_used=None))
    if key.team_id == TEAM_ID:
        # As gateways from before teams wrote it, which read no team: a rolling upgrade's
        # older gateways go on reading the default team's keys.
        del fields["team_id"]
    return json.dumps(fields)


def _key(record: str) -> ApiKey:
    return ApiKey(**json.loads(record))


def _float(value: str | None) -> float | None:
    return None if value is None else float(value)
