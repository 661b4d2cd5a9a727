"""A cluster's webhooks, in Redis: registered through any gateway, delivered by every node.

Each webhook is one field of a hash (`Keys.webhooks`: id -> its record, secret included: the
nodes sign with it). Every node's agent mirrors the whole set into its catalog at each
heartbeat (`StateSource.mirror_webhooks`), and each node delivers its own sandboxes' events
(`orchestrator.webhook_delivery`): a registration reaches the nodes within a heartbeat, and
an event a node writes before then is not queued for it. Like the API keys, the set is the one
part of this the nodes cannot rebuild: a Redis wiped without persistence loses it (each node's
copy then goes at its next mirror).
"""

from __future__ import annotations

import dataclasses
import json
from typing import cast

import redis.asyncio as aioredis

from aenv.cluster.store import Keys, guarded
from aenv.orchestrator.webhooks import Webhook


def _record(hook: Webhook) -> str:
    return json.dumps(dataclasses.asdict(hook))


def _webhook(record: str | bytes) -> Webhook:
    fields = json.loads(record)
    return Webhook(**{**fields, "events": tuple(fields["events"])})


class ClusterWebhooks:
    def __init__(self, client: aioredis.Redis, keys: Keys | None = None) -> None:
        self.client = client
        self.keys = keys or Keys()

    async def all(self) -> list[Webhook]:
        """Every team's webhooks, oldest first."""
        async with guarded(self.client, "reading the webhooks"):
            records = cast("dict[str, str]", await self.client.hgetall(self.keys.webhooks))
        return sorted((_webhook(r) for r in records.values()), key=lambda h: (h.created_at, h.id))

    async def get(self, team_id: str, webhook_id: str) -> Webhook | None:
        async with guarded(self.client, f"reading webhook {webhook_id}"):
            record = await self.client.hget(self.keys.webhooks, webhook_id)
        hook = None if record is None else _webhook(record)
        return hook if hook is not None and hook.team_id == team_id else None

    async def put(self, hook: Webhook) -> None:
        """Register `hook`, or replace the webhook of its id."""
        async with guarded(self.client, f"writing webhook {hook.id}"):
            await self.client.hset(self.keys.webhooks, hook.id, _record(hook))

    async def delete(self, team_id: str, webhook_id: str) -> bool:
        if await self.get(team_id, webhook_id) is None:
            return False
        async with guarded(self.client, f"deleting webhook {webhook_id}"):
            return bool(await self.client.hdel(self.keys.webhooks, webhook_id))
