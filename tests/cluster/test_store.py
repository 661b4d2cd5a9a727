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
from tests.support.wait import eventually


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
    observer = aioredis.Redis.from_url(redis.url)
    try:

        async def popping() -> bool:
            return any(c["cmd"] == "blpop" for c in await observer.client_list())

        # The pop holds the one connection once Redis has it (a fixed pause before the check
        # let the check take the connection first on a stalled host).
        await eventually(popping, "the blocking pop reached Redis")
        with pytest.raises(ClusterUnavailable, match=r"did not answer within 0\.5 s while looking"):
            await Routes(client).lookup("sb1")
    finally:
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        await client.aclose()
        await observer.aclose()


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
