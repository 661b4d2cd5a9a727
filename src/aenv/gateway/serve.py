"""Running a gateway: its settings from the configuration, the check of its secret at start, and
the server until SIGINT or SIGTERM. A gateway writes the cluster's admin token into its home."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from aenv.api.limits import RateLimiter
from aenv.cluster.directory import Directory
from aenv.cluster.keys import ClusterKeys, sync_keys
from aenv.cluster.membership import cluster_access
from aenv.cluster.secret import ClusterSecret
from aenv.cluster.store import ClusterUnavailable, connect
from aenv.config import Config, Paths
from aenv.gateway.app import Gateway
from aenv.gateway.team_quota import TeamLimitSettings
from aenv.orchestrator.identity_keys import node_signer
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
        write_admin_token(config.paths.admin_token, settings.secret.admin_token)
        keys = ClusterKeys(client)
        synced = await _sync(keys, config.paths, progress, quiet=False)
        syncing = asyncio.create_task(_keep_keys(keys, config.paths, progress, quiet=not synced))
        limiter = RateLimiter(
            config.key_requests_per_s, config.key_request_burst, config.create_max_wait
        )
        gateway = Gateway(
            directory,
            settings.secret,
            keys,
            limiter,
            config.domain,
            config.key_max_sandboxes,
            node_signer(config),
            config.team_max_sandboxes,
            TeamLimitSettings.of(config),
        )
        try:
            await uvicorn.Server(uvicorn_config(gateway, config)).serve()
        finally:
            syncing.cancel()
            await gateway.aclose()
    finally:
        await client.aclose()


def write_admin_token(path: Path, token: str) -> None:
    """The cluster's admin token in the gateway's home (0600), where `aenv teams` and `aenv keys
    create --team` run by the gateway's operator find it, as a node's operator finds the node's."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")


# How often a gateway refreshes its copy of the cluster's keys, and restores them into a Redis
# found without any.
KEYS_SYNC_S = 5.0


async def _keep_keys(
    keys: ClusterKeys, paths: Paths, progress: Callable[[str], None], quiet: bool
) -> None:
    """`sync_keys` every `KEYS_SYNC_S` until the gateway stops."""
    while True:
        await asyncio.sleep(KEYS_SYNC_S)
        quiet = not await _sync(keys, paths, progress, quiet)


async def _sync(
    keys: ClusterKeys, paths: Paths, progress: Callable[[str], None], quiet: bool
) -> bool:
    """One `sync_keys`; False while Redis is down (said once unless `quiet`)."""
    try:
        if await sync_keys(keys, paths):
            progress(f"generated the cluster's first API key; it is in {paths.api_key}")
    except ClusterUnavailable as error:
        if not quiet:
            progress(f"the cluster's API keys are not synced, retrying: {error}")
        return False
    return True
