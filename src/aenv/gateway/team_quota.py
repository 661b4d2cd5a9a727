"""A team's creates a second and its disk, held across the cluster at the gateways
(`aenv.cluster.team_limits` counts them in Redis), before a create, fork or volume reaches a node.

- Creates and forks take one of the team's creates of this second first. One whose client asked
  to wait (`X-Aenv-Wait`) waits its turn, up to its wait (cut to `create_max_wait`), as a key's
  requests wait theirs; else, or past its wait, E2B's 429 with `Retry-After`.
- A create holds its sandbox's disk (its template's `diskSizeMB`) from before it is placed to
  the node's answer, when the node has counted the sandbox; a volume its size. Past the team's
  `team_max_disk_mb` on all nodes, E2B's 429. A template's disk is read from its published
  record (`aenv.cluster.saved`) or, for a node's own templates, from the first live node that
  answers for it, and kept `DISK_CACHE_S`; a template no node knows holds none (the node's 404
  is the answer). A volume's disk is counted by its node at its next heartbeat, not at once as
  a sandbox's: its reservation is kept `VOLUME_HOLD_S` past the node's answer to cover that.
- A fork's children are counted by their nodes (`team_max_disk_mb` there), not here: the
  gateway does not know the parent's disk before the node forks it.

Each node also holds its own `team_creates_per_s` and `team_max_disk_mb` for itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import quote

from starlette.requests import Request

from aenv.api.errors import APIError
from aenv.api.limits import retry_after
from aenv.cluster.directory import Directory
from aenv.cluster.registry import NodeReport
from aenv.cluster.store import ClusterUnavailable
from aenv.cluster.team_limits import TeamDiskReached, TeamLimits, TeamRateReached
from aenv.config import Config
from aenv.gateway.nodes import Answer, NodeUnreachable
from aenv.orchestrator.templates import template_from_json

# How long a template's disk size, once read, is used for a team's creates from it.
DISK_CACHE_S = 30.0
DISK_CACHE_SIZE = 4096
# How long a volume's disk stays reserved after its node made it: past a heartbeat.
VOLUME_HOLD_S = 15.0

log = logging.getLogger("aenv.gateway")

# A call on one node for the client's request: method, path and query, body.
NodeCall = Callable[[Request, NodeReport, str, str, bytes], Awaitable[Answer]]


@dataclass(frozen=True)
class TeamLimitSettings:
    """The gateway's settings of a team's limits (see `aenv.config.Config`)."""

    creates_per_s: float = Config().team_creates_per_s
    max_disk_mb: int = Config().team_max_disk_mb
    max_wait: float = Config().create_max_wait
    volume_size_mb: int = Config().volume_size_mb

    @classmethod
    def of(cls, config: Config) -> TeamLimitSettings:
        return cls(
            config.team_creates_per_s,
            config.team_max_disk_mb,
            config.create_max_wait,
            config.volume_size_mb,
        )


DEFAULT_TEAM_LIMITS = TeamLimitSettings()


class TeamQuota:
    def __init__(self, directory: Directory, settings: TeamLimitSettings) -> None:
        self.directory = directory
        self.settings = settings
        self.limits = TeamLimits(directory.client, directory.registry.keys)
        self._disks: dict[tuple[str, str], tuple[int, float]] = {}

    async def take_create(self, team_id: str, wait: float) -> float:
        """One of the team's creates of this second, waited for up to `wait` seconds (cut to
        `create_max_wait`): the seconds waited. Raises `APIError` 429 with `Retry-After`."""
        held = min(wait, self.settings.max_wait)
        try:
            ahead = await self.limits.take_create(team_id, self.settings.creates_per_s, held)
        except TeamRateReached as error:
            seconds = int(retry_after(error.retry_in))
            raise APIError(429, str(error), retry_after=seconds) from error
        if ahead > 0:
            await asyncio.sleep(ahead)  # its turn in the team's rate
        return ahead

    @contextlib.asynccontextmanager
    async def disk(self, team_id: str, need_mb: int, hold_s: float = 0.0) -> AsyncIterator[None]:
        """`need_mb` of the team's disk held while the block runs, and `hold_s` after it
        succeeded; E2B's 429 when it does not fit."""
        try:
            token = await self.limits.reserve_disk(team_id, need_mb, self.settings.max_disk_mb)
        except TeamDiskReached as error:
            raise APIError(429, str(error)) from error
        held = False
        try:
            yield
            held = hold_s > 0
        finally:
            try:
                if held:
                    await self.limits.keep_disk(team_id, token, hold_s)
                else:
                    await self.limits.release_disk(team_id, token)
            except ClusterUnavailable as error:
                log.warning(
                    "disk reservation %s of %s lapses on its own: %s", token, team_id, error
                )

    async def create_disk(self, request: Request, team_id: str, ref: str, call: NodeCall) -> int:
        """The disk (MiB) a sandbox from template `ref` takes; 0 when no node knows it."""
        cached = self._disks.get((team_id, ref))
        if cached is not None and cached[1] > time.monotonic():
            return cached[0]
        saved = await self.directory.saved.find(ref, team_id)
        if saved is not None:
            disk = template_from_json(saved.record).disk_size_mb
        else:
            disk = await self._asked(request, ref, call)
        now = time.monotonic()
        if len(self._disks) >= DISK_CACHE_SIZE:  # bounded: the lapsed go first, else all
            lapsed = [k for k, (_, until) in self._disks.items() if until <= now]
            for k in lapsed or list(self._disks):
                del self._disks[k]
        self._disks[(team_id, ref)] = (disk, now + DISK_CACHE_S)
        return disk

    async def _asked(self, request: Request, ref: str, call: NodeCall) -> int:
        """The template's disk as the first live node that knows it answers; 0 for none."""
        target = f"/templates/{quote(ref, safe='')}"
        for node in await self.directory.live():
            try:
                answer = await call(request, node, "GET", target, b"")
            except (NodeUnreachable, APIError):
                continue
            if answer.status == 200:
                builds = json.loads(answer.body).get("builds") or [{}]
                return int(builds[0].get("diskSizeMB") or 0)
        return 0

    def volume_disk(self, body: bytes) -> int:
        """The disk (MiB) a `POST /volumes` asks for: its `sizeMB`, else the default."""
        try:
            size = json.loads(body).get("sizeMB")
        except (ValueError, AttributeError):
            size = None
        return size if isinstance(size, int) and size > 0 else self.settings.volume_size_mb
