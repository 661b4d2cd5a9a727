"""A node's membership in a cluster: its settings read from the configuration, and the heartbeat
task that runs beside the server for as long as the node serves."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from aenv.cluster.agent import NodeAgent, StateSource
from aenv.cluster.drain import DrainMemory
from aenv.cluster.secret import ClusterSecret, WeakSecret
from aenv.cluster.store import ClusterUnavailable, connect
from aenv.config import Config, ConfigError

log = logging.getLogger("aenv.cluster")


def cluster_access(config: Config, role: str) -> tuple[str, ClusterSecret]:
    """The Redis URL and cluster secret every cluster role (`role`: "a gateway") needs; raises
    `ConfigError` naming what is missing or too weak."""
    if config.redis_url is None:
        raise ConfigError(f"redis_url (AENV_REDIS_URL) is required for {role}")
    if config.cluster_secret is None:
        raise ConfigError(f"cluster_secret (AENV_CLUSTER_SECRET) is required for {role}")
    try:
        return config.redis_url, ClusterSecret(config.cluster_secret)
    except WeakSecret as error:
        raise ConfigError(f"cluster_secret: {error}") from error


@dataclass(frozen=True)
class NodeSettings:
    redis_url: str
    node_id: str
    address: str
    secret: ClusterSecret
    interval: float
    ttl: float
    drain_file: Path  # `aenv.cluster.drain.DrainMemory`

    @classmethod
    def of(cls, config: Config) -> NodeSettings:
        """The node role's settings; raises `ConfigError` naming what is missing or unusable."""
        redis_url, secret = cluster_access(config, "a cluster node")
        if not 0 < config.heartbeat_interval < config.lease_ttl:
            raise ConfigError("heartbeat_interval must be above 0 and below lease_ttl")
        return cls(
            redis_url=redis_url,
            node_id=config.node_id or socket.gethostname(),
            address=config.node_address or f"{config.host}:{config.port}",
            secret=secret,
            interval=config.heartbeat_interval,
            ttl=config.lease_ttl,
            drain_file=config.paths.cluster_drain,
        )


@asynccontextmanager
async def membership(
    settings: NodeSettings, source: StateSource, drain: DrainMemory | None = None
) -> AsyncIterator[NodeAgent]:
    """Registers the node and heartbeats until the body ends, then gives the id up. The node's
    memory of its drain is `drain` when given (the internal API reads it too), else its own.

    A node id held by another process or a wrong secret fails here, at start-up. Redis being
    down does not: the node serves its own sandboxes and registers once Redis answers.
    """
    client = connect(settings.redis_url)
    agent = NodeAgent(
        client,
        settings.node_id,
        settings.address,
        source,
        settings.secret,
        settings.ttl,
        drain=drain or DrainMemory(settings.drain_file),
    )
    try:
        try:
            await agent.beat()
        except ClusterUnavailable as error:
            log.warning("node %s starts unregistered: %s", settings.node_id, error)
        beats = asyncio.create_task(agent.run(settings.interval))
        try:
            yield agent
        finally:
            beats.cancel()
            await asyncio.gather(beats, return_exceptions=True)
            await agent.close()
    finally:
        await client.aclose()
