"""What the cluster tests share: the secret their nodes form the cluster with, and a gateway of
that cluster."""

from typing import Any

import redis.asyncio as aioredis

from aenv.api.limits import RateLimiter
from aenv.cluster.directory import Directory
from aenv.cluster.keys import ClusterKeys
from aenv.cluster.secret import ClusterSecret
from aenv.gateway.app import Gateway

SECRET = ClusterSecret("test-cluster-secret-0123456789")


def gateway_over(client: aioredis.Redis, rate: int = 1000, **settings: Any) -> Gateway:
    """A gateway of the cluster whose store `client` reaches (a client of the gateway's own: it
    serves on a loop of its own), its keys the cluster's, `rate` calls a second (and as many at
    once) per key: by default more than a test makes. `settings` are the Gateway's others."""
    keys = ClusterKeys(client)
    return Gateway(Directory(client, SECRET), SECRET, keys, RateLimiter(rate, rate), **settings)
