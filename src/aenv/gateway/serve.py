"""Running a gateway: its settings from the configuration, the check of its secret at start, and
the server until SIGINT or SIGTERM."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn

from aenv.api.keys import open_keys
from aenv.api.limits import RateLimiter
from aenv.cluster.directory import Directory
from aenv.cluster.membership import cluster_access
from aenv.cluster.secret import ClusterSecret
from aenv.cluster.store import ClusterUnavailable, connect
from aenv.config import Config
from aenv.gateway.app import Gateway
from aenv.serving import uvicorn_config

log = logging.getLogger("aenv.gateway")


@dataclass(frozen=True)
class GatewaySettings:
    redis_url: str
    secret: ClusterSecret

    @classmethod
    def of(cls, config: Config) -> GatewaySettings:
        """Raises `ConfigError` naming what is missing or unusable."""
        return cls(*cluster_access(config, "a gateway"))


async def run_gateway(
    config: Config, settings: GatewaySettings, progress: Callable[[str], None] = log.info
) -> None:
    """Serves until stopped. A secret other than the cluster's fails here (`WrongClusterSecret`);
    Redis being down does not: the gateway answers 503 until it is back."""
    client = connect(settings.redis_url)
    try:
        directory = Directory(client, settings.secret)
        try:
            await directory.check_secret()
        except ClusterUnavailable as error:
            progress(f"starting without the cluster store, answering 503 until it is back: {error}")
        config.home.mkdir(parents=True, exist_ok=True, mode=0o700)
        keys, created = open_keys(config.paths)
        if created:
            progress(f"generated an API key; it is in {config.paths.api_key} (mode 0600)")
        limiter = RateLimiter(config.key_requests_per_s, config.key_request_burst)
        gateway = Gateway(directory, settings.secret, keys, limiter, config.domain)
        try:
            await uvicorn.Server(uvicorn_config(gateway, config)).serve()
        finally:
            await gateway.aclose()
    finally:
        await client.aclose()
