"""The cluster's teams, in Redis, as a node keeps its own in its catalog (`orchestrator.teams`):
id, name (unique), created. The gateways' admin routes (`aenv.gateway.admin`) make and delete
them; a key's team must be one of them.

The default team (`ids.TEAM_ID`, named as its id) is every cluster's and is not stored: what a
cluster held before teams is its. A team is created with its name claimed in one script, so two
gateways creating the same name make one team.
"""

from __future__ import annotations

import builtins
import json
import time
import uuid
from collections.abc import Awaitable
from typing import cast

import redis.asyncio as aioredis

from aenv.cluster.store import Keys, guarded
from aenv.ids import TEAM_ID
from aenv.orchestrator.teams import Team, TeamNameTaken

# KEYS: teams, team names. ARGV: id, name, record. Returns 0 when the name is taken.
_CREATE = """
if redis.call('HSETNX', KEYS[2], ARGV[2], ARGV[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"""

# KEYS: teams, team names. ARGV: id. Returns 0 for an unknown team.
_DELETE = """
local record = redis.call('HGET', KEYS[1], ARGV[1])
if not record then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], cjson.decode(record)['name'])
return 1
"""

DEFAULT = Team(TEAM_ID, TEAM_ID, 0.0)


class ClusterTeams:
    """Every method raises `ClusterUnavailable` while Redis does not answer."""

    def __init__(self, client: aioredis.Redis, keys: Keys | None = None) -> None:
        self.client = client
        self.names = keys or Keys()
        self._create = client.register_script(_CREATE)
        self._delete = client.register_script(_DELETE)

    async def list(self) -> builtins.list[Team]:
        async with guarded(self.client, "listing teams"):
            stored = await cast("Awaitable[dict[str, str]]", self.client.hgetall(self.names.teams))
        teams = [_team(record) for record in stored.values()]
        return [DEFAULT, *sorted(teams, key=lambda t: (t.created_at, t.id))]

    async def get(self, team_id: str) -> Team | None:
        if team_id == TEAM_ID:
            return DEFAULT
        async with guarded(self.client, f"reading team {team_id}"):
            record = await cast(
                "Awaitable[str | None]", self.client.hget(self.names.teams, team_id)
            )
        return None if record is None else _team(record)

    async def named(self, team_id: str) -> str:
        """The team's name; its id for a team the cluster does not hold (deleted meanwhile)."""
        team = await self.get(team_id)
        return team.name if team is not None else team_id

    async def create(self, name: str, team_id: str | None = None) -> Team:
        """A new team (a random id unless given). Raises `TeamNameTaken`."""
        team = Team(team_id or str(uuid.uuid4()), name, time.time())
        if name == TEAM_ID or team.id == TEAM_ID:
            raise TeamNameTaken(name)
        record = json.dumps({"id": team.id, "name": team.name, "created_at": team.created_at})
        async with guarded(self.client, f"creating team {name}"):
            made = await self._create(
                [self.names.teams, self.names.team_names], [team.id, name, record]
            )
        if not made:
            raise TeamNameTaken(name)
        return team

    async def delete(self, team_id: str) -> bool:
        """False for an unknown team (the default one is never deleted: the caller refuses)."""
        async with guarded(self.client, f"deleting team {team_id}"):
            done = await self._delete([self.names.teams, self.names.team_names], [team_id])
        return bool(done)


def _team(record: str) -> Team:
    return Team(**json.loads(record))
