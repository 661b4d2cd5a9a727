"""The guard around every Redis call: a wait the client itself does not bound still ends."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, cast

import pytest
import redis.asyncio as aioredis

from aenv.cluster import store
from aenv.cluster.routing import Routes
from aenv.cluster.store import ClusterUnavailable
from tests.support.redis_server import RedisServer


async def test_a_pool_that_never_hands_out_a_connection_fails_clearly(
    redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store, "DEADLINE", 0.5)
    # One connection, held by a blocking pop that never returns: the next command waits on the
    # pool, which no socket timeout covers.
    pool = aioredis.BlockingConnectionPool.from_url(
        redis.url, max_connections=1, timeout=None, decode_responses=True
    )
    client = aioredis.Redis(connection_pool=pool)
    blocking_pop = cast("Coroutine[Any, Any, object]", client.blpop(["never"], timeout=0))
    held = asyncio.create_task(blocking_pop)
    try:
        await asyncio.sleep(0.1)
        with pytest.raises(ClusterUnavailable, match=r"did not answer within 0\.5 s while looking"):
            await Routes(client).lookup("sb1")
    finally:
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        await client.aclose()


async def test_more_commands_at_once_than_the_pool_holds_wait_their_turn(
    redis: RedisServer,
) -> None:
    """A burst past the pool's size (a gateway under 200 creates) waits for connections instead
    of failing with redis-py's "Too many connections"."""
    client = store.connect(redis.url)
    try:
        count = store.POOL_SIZE * 3
        pops = [
            cast("Coroutine[Any, Any, object]", client.blpop([f"empty-{i}"], timeout=0.2))
            for i in range(count)
        ]
        assert await asyncio.gather(*pops) == [None] * count
    finally:
        await client.aclose()
