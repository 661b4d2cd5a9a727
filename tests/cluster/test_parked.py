"""The records of parked sandboxes, sealed in Redis under the cluster's key: read raw from a
real redis-server, they show no egress proxy password or header rule value."""

from __future__ import annotations

import json
from collections.abc import Awaitable
from typing import cast

import pytest
import redis.asyncio as aioredis

from aenv.cluster.parked import Parked
from aenv.cluster.sealed import Unsealable
from aenv.cluster.store import Keys
from tests.cluster.shared import SECRET
from tests.cluster.test_secrets import OTHER, raw_redis


async def test_parked_records_are_sealed_in_redis(client: aioredis.Redis) -> None:
    """A parked sandbox's record holds its egress proxy's password and its rules' values: Redis
    shows neither, a gateway reads the record whole, and a record moved to another sandbox's
    key or read under another cluster's secret does not open."""
    record = json.dumps(
        {"id": "sbx1", "proxy": "socks5://u:proxy-pa55word@h:1080", "rule": "Bearer rule-t0ken"}
    )
    parked = Parked(client, SECRET)
    assert await parked.publish("n1", "sbx1", record)
    await parked.released("sbx2", record)
    stored = await raw_redis(client)
    assert "proxy-pa55word" not in stored and "rule-t0ken" not in stored
    found = await parked.get("sbx1")
    assert found is not None and found.record == record and found.node_id == "n1"
    released = await parked.get("sbx2")
    assert released is not None and released.record == record and released.node_id == ""

    with pytest.raises(Unsealable):
        await Parked(client, OTHER).get("sbx1")
    moved = await cast("Awaitable[str]", client.hget(Keys().parked("sbx1"), "record"))
    await client.hset(Keys().parked("sbx3"), mapping={"node": "n1", "record": moved})
    with pytest.raises(Unsealable):
        await parked.get("sbx3")
    # A record a node of the previous release published, in plain JSON, is still read.
    await client.hset(Keys().parked("sbx4"), mapping={"node": "n1", "record": record})
    legacy = await parked.get("sbx4")
    assert legacy is not None and legacy.record == record
