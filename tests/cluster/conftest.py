"""A real redis-server per test (started in a few milliseconds), and a client to it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from aenv.cluster.store import connect
from tests.support.redis_server import RedisServer, redis_server


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path) as server:
        yield server


@pytest.fixture
async def client(redis: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = connect(redis.url, timeout=1.0)
    try:
        yield client
    finally:
        await client.aclose()
