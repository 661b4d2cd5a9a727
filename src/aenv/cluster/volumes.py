"""Where volumes live: volume id -> the node whose disk holds its files, and names -> ids.

A volume's files are one node's (a directory shared into its guests over virtio-9p), so its
calls and the sandboxes that mount it go to that node. Names are unique per team, as on a node:
a gateway reserves the team's name (`HSETNX`, value "") before a node creates the volume, and
records the id once it has. The names hash holds a default-team volume under its name, as
before teams (so older gateways still find them), and another team's under `<team>/<name>`
(`/` is in no volume name, so the two never meet). The node stays the source of truth: a
record lost with a Redis wipe is found again by asking the live nodes (`aenv.gateway.volumes`).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import cast

import redis.asyncio as aioredis

from aenv.cluster.store import Keys, guarded, team_field
from aenv.ids import TEAM_ID


@dataclass(frozen=True)
class VolumePlace:
    volume_id: str
    name: str
    node_id: str
    team_id: str = TEAM_ID


class VolumePlaces:
    def __init__(self, client: aioredis.Redis, keys: Keys | None = None) -> None:
        self.client = client
        self.keys = keys or Keys()

    async def reserve(self, team_id: str, name: str) -> bool:
        """Claims the team's `name` for a volume about to be created; False when it is taken."""
        async with guarded(self.client, f"reserving volume name {name}"):
            taken = await self.client.hsetnx(self.keys.volume_names, team_field(team_id, name), "")
        return bool(taken)

    async def unreserve(self, team_id: str, name: str) -> None:
        """Gives up a reservation whose create failed (a recorded name is left alone)."""
        field = team_field(team_id, name)
        async with guarded(self.client, f"releasing volume name {name}"):
            current = await cast(
                "Awaitable[str | None]", self.client.hget(self.keys.volume_names, field)
            )
            if current == "":
                await self.client.hdel(self.keys.volume_names, field)

    async def record(self, place: VolumePlace) -> None:
        doing = f"recording volume {place.volume_id}"
        where = {"node": place.node_id, "name": place.name, "team": place.team_id}
        async with guarded(self.client, doing), self.client.pipeline(transaction=True) as pipe:
            pipe.set(self.keys.volume(place.volume_id), json.dumps(where))
            pipe.hset(
                self.keys.volume_names, team_field(place.team_id, place.name), place.volume_id
            )
            await pipe.execute()

    async def forget(self, place: VolumePlace) -> None:
        doing = f"forgetting volume {place.volume_id}"
        async with guarded(self.client, doing), self.client.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.volume(place.volume_id))
            pipe.hdel(self.keys.volume_names, team_field(place.team_id, place.name))
            await pipe.execute()

    async def find(self, ref: str, team_id: str | None) -> VolumePlace | None:
        """The volume named (by `team_id`; the default team's for None) or with the id `ref`,
        where it lives; None when not recorded, or another team's."""
        async with guarded(self.client, f"finding volume {ref}"):
            volume_id = await cast(
                "Awaitable[str | None]",
                self.client.hget(self.keys.volume_names, team_field(team_id or TEAM_ID, ref)),
            )
            volume_id = volume_id or ref
            found = await cast(
                "Awaitable[str | None]", self.client.get(self.keys.volume(volume_id))
            )
        if found is None:
            return None
        place = json.loads(found)
        team = place.get("team", TEAM_ID)  # recorded before teams: the default team's
        if team_id is not None and team != team_id:
            return None
        return VolumePlace(volume_id, place["name"], place["node"], team)

    async def of_team(self, team_id: str) -> list[str]:
        """The ids of the volumes recorded as the team's (names reserved for a create under
        way left out), for a team other than the default one."""
        found: list[str] = []
        async with guarded(self.client, f"listing the volumes of team {team_id}"):
            async for _, volume_id in self.client.hscan_iter(
                self.keys.volume_names, match=f"{team_field(team_id, '')}*"
            ):
                if volume_id:
                    found.append(volume_id)
        return found
