"""A cluster's webhooks, in Redis: registered through any gateway, delivered by every node.

Each webhook is one field of a hash (`Keys.webhooks`: id -> its record, secret included: the
nodes sign with it). Every node's agent mirrors the whole set into its catalog at each
heartbeat (`StateSource.mirror_webhooks`), and each node delivers its own sandboxes' events
(`orchestrator.webhook_delivery`): a registration reaches the nodes within a heartbeat, and
an event a node writes before then is not queued for it. Like the API keys, the set is the one
part of this the nodes cannot rebuild: a Redis wiped without persistence loses it (each node's
copy then goes at its next mirror).

Two gateways may change one webhook at once: an update or a delete reads the record, and writes
only if the record is still the one it read (one script: compare and set), else reads again,
so a `PATCH` never undoes another's change to other fields, nor brings back a webhook another
gateway deleted meanwhile. Writes that keep losing (`_TRIES`) fail with `ConflictingWrites`
(a 409), having stored nothing.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Mapping
from typing import Any, cast

import redis.asyncio as aioredis

from aenv.cluster.secrets import ConflictingWrites
from aenv.cluster.store import Keys, guarded
from aenv.orchestrator.webhooks import Webhook

# KEYS: the webhooks hash. ARGV: id, the record read, the new record ("": delete it). Returns 0
# when the record is no longer the one read (another gateway wrote it meanwhile).
_SWAP = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
if ARGV[3] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
end
return 1
"""

# Writes that lost a race with another gateway's are tried again this many times.
_TRIES = 8


def _record(hook: Webhook) -> str:
    return json.dumps(dataclasses.asdict(hook))


def _webhook(record: str | bytes) -> Webhook:
    fields = json.loads(record)
    return Webhook(**{**fields, "events": tuple(fields["events"])})


class ClusterWebhooks:
    def __init__(self, client: aioredis.Redis, keys: Keys | None = None) -> None:
        self.client = client
        self.keys = keys or Keys()
        self._swap = client.register_script(_SWAP)

    async def all(self) -> list[Webhook]:
        """Every team's webhooks, oldest first."""
        async with guarded(self.client, "reading the webhooks"):
            records = cast("dict[str, str]", await self.client.hgetall(self.keys.webhooks))
        return sorted((_webhook(r) for r in records.values()), key=lambda h: (h.created_at, h.id))

    async def _read(self, team_id: str, webhook_id: str) -> tuple[str, Webhook] | None:
        """The webhook's record as stored, and the webhook; None when it is not the team's."""
        async with guarded(self.client, f"reading webhook {webhook_id}"):
            record = await cast(
                "Awaitable[str | None]", self.client.hget(self.keys.webhooks, webhook_id)
            )
        if record is None:
            return None
        hook = _webhook(record)
        return (record, hook) if hook.team_id == team_id else None

    async def get(self, team_id: str, webhook_id: str) -> Webhook | None:
        found = await self._read(team_id, webhook_id)
        return None if found is None else found[1]

    async def put(self, hook: Webhook) -> None:
        """Register `hook` (a new id)."""
        async with guarded(self.client, f"writing webhook {hook.id}"):
            await self.client.hset(self.keys.webhooks, hook.id, _record(hook))

    async def update(
        self, team_id: str, webhook_id: str, changes: Mapping[str, Any]
    ) -> Webhook | None:
        """The team's webhook with `changes` (by `Webhook` field) made to it as it is stored
        now; None when it is not the team's (or was deleted meanwhile). Raises
        `ConflictingWrites`."""
        for _ in range(_TRIES):
            found = await self._read(team_id, webhook_id)
            if found is None:
                return None
            record, hook = found
            updated = dataclasses.replace(hook, **changes)
            if await self._swapped(webhook_id, record, _record(updated)):
                return updated
        raise ConflictingWrites(f"webhook '{webhook_id}' changed {_TRIES} times while updated")

    async def delete(self, team_id: str, webhook_id: str) -> bool:
        """False when it is not the team's. Raises `ConflictingWrites`."""
        for _ in range(_TRIES):
            found = await self._read(team_id, webhook_id)
            if found is None:
                return False
            if await self._swapped(webhook_id, found[0], ""):
                return True
        raise ConflictingWrites(f"webhook '{webhook_id}' changed {_TRIES} times while deleted")

    async def _swapped(self, webhook_id: str, read: str, record: str) -> bool:
        async with guarded(self.client, f"writing webhook {webhook_id}"):
            return bool(await self._swap([self.keys.webhooks], [webhook_id, read, record]))
