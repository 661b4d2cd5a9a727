"""A cluster's webhooks changed by several gateways at once, in a real redis-server: each update
is made to the webhook as stored when it is written, so concurrent changes of different fields
all stay, and a webhook deleted meanwhile is not brought back by an update that read it
before. (Through two real gateways over HTTP: tests/cluster/test_gateway.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import redis.asyncio as aioredis

from aenv.cluster.webhooks import ClusterWebhooks
from aenv.orchestrator.webhooks import new_webhook


async def test_concurrent_updates_of_a_webhook_all_stay(client: aioredis.Redis) -> None:
    hooks = ClusterWebhooks(client)
    hook = new_webhook("local", "h", "https://hooks.example.com/", True, ["x"], "secret")
    await hooks.put(hook)
    changes: list[dict[str, Any]] = [
        {"name": "renamed"},
        {"url": "https://other.example.com/"},
        {"enabled": False},
        {"events": ("y", "z")},
        {"secret": "another"},
    ]
    # Every update reads before any writes: a read-then-write would keep the last one only.
    done = await asyncio.gather(*(hooks.update("local", hook.id, c) for c in changes * 4))
    assert all(d is not None for d in done)
    stored = await hooks.get("local", hook.id)
    assert stored is not None
    assert (stored.name, stored.url, stored.enabled, stored.events, stored.secret) == (
        "renamed",
        "https://other.example.com/",
        False,
        ("y", "z"),
        "another",
    )
    assert (stored.id, stored.team_id, stored.created_at) == (hook.id, "local", hook.created_at)
    # Another team's update is none.
    assert await hooks.update("other", hook.id, {"name": "theirs"}) is None


async def test_an_update_racing_a_delete_does_not_bring_the_webhook_back(
    client: aioredis.Redis,
) -> None:
    hooks = ClusterWebhooks(client)
    for _ in range(5):
        hook = new_webhook("local", "h", "https://hooks.example.com/", True, ["x"], "secret")
        await hooks.put(hook)
        racing: list[Awaitable[object]] = [hooks.delete("local", hook.id)]
        racing += [hooks.update("local", hook.id, {"name": f"n{i}"}) for i in range(5)]
        deleted, *_ = await asyncio.gather(*racing)
        assert deleted is True
        assert await hooks.get("local", hook.id) is None
        assert await hooks.all() == []
        assert await hooks.delete("local", hook.id) is False
