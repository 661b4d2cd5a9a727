"""Snapshots and built templates any node can start sandboxes from: their records, published in
Redis by the nodes that hold them, whose files are in the cluster's shared snapshot repository.

A node publishes each snapshot or built template whose copy reached the repository (its agent,
every heartbeat) and withdraws it when it deletes it. The record outlives its node: a gateway
placing a create from one on a node that lacks it has the node adopt the record first
(`api.handoff.ADOPT_TEMPLATE`), and the node pulls the files. Names map to ids in a second hash,
so a create may name a snapshot as E2B allows; names are the team's (`store.team_field`), so
two teams' snapshots of one name each stay found by their own team.

A published record is the template's record with its tags (`tags.with_tags`), so a node
adopting it later, or a gateway once its nodes are gone, knows the tags its holders gave it.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import cast

import redis.asyncio as aioredis

from aenv.cluster.store import Keys, guarded, team_field
from aenv.ids import TEAM_ID
from aenv.orchestrator.tags import with_tags, without_tags


@dataclass(frozen=True)
class SavedRecord:
    template_id: str
    names: tuple[str, ...]
    created_at: float
    source_sandbox_id: str | None
    record: str  # `aenv.orchestrator.templates.template_to_json`
    kind: str = "snapshot"  # `aenv.orchestrator.kinds.TemplateKind`
    build_id: str = ""
    tags: Mapping[str, str] = field(default_factory=dict)  # tag -> build id
    team_id: str = TEAM_ID

    @classmethod
    def of(cls, published: str) -> SavedRecord:
        record, tags = without_tags(published)
        raw = json.loads(record)
        return cls(
            raw["template_id"],
            tuple(raw.get("aliases", ())),
            float(raw.get("created_at", 0.0)),
            raw.get("source_sandbox_id"),
            record,
            str(raw.get("kind", "snapshot")),
            str(raw.get("build_id", "")),
            tags,
            str(raw.get("team_id", TEAM_ID)),
        )

    @property
    def published(self) -> str:
        """The record as published and adopted: with its tags."""
        return with_tags(self.record, self.tags)


class SavedRecords:
    def __init__(self, client: aioredis.Redis, keys: Keys | None = None) -> None:
        self.client = client
        self.keys = keys or Keys()

    async def publish(self, record: SavedRecord) -> None:
        doing = f"publishing snapshot {record.template_id}"
        async with guarded(self.client, doing), self.client.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.saved, record.template_id, record.published)
            for name in record.names:
                pipe.hset(
                    self.keys.saved_names, team_field(record.team_id, name), record.template_id
                )
            await pipe.execute()

    async def withdraw(
        self, template_id: str, names: tuple[str, ...] = (), team_id: str = TEAM_ID
    ) -> None:
        doing = f"withdrawing snapshot {template_id}"
        async with guarded(self.client, doing), self.client.pipeline(transaction=True) as pipe:
            pipe.hdel(self.keys.saved, template_id)
            if names:
                pipe.hdel(self.keys.saved_names, *(team_field(team_id, n) for n in names))
            await pipe.execute()

    async def find(self, ref: str, team_id: str = TEAM_ID) -> SavedRecord | None:
        """By id, or by name (`name:tag` as a create may give it): `team_id`'s, else the
        default team's (the node's public templates are)."""
        name = ref.split(":", 1)[0]
        async with guarded(self.client, f"reading snapshot {ref}"):
            record = await cast("Awaitable[str | None]", self.client.hget(self.keys.saved, name))
            if record is None:
                template_id = None
                for team in dict.fromkeys((team_id, TEAM_ID)):
                    template_id = template_id or await cast(
                        "Awaitable[str | None]",
                        self.client.hget(self.keys.saved_names, team_field(team, name)),
                    )
                if template_id is None:
                    return None
                record = await cast(
                    "Awaitable[str | None]", self.client.hget(self.keys.saved, template_id)
                )
        return None if record is None else SavedRecord.of(record)

    async def all(self) -> list[SavedRecord]:
        async with guarded(self.client, "listing snapshots"):
            records = await cast("Awaitable[dict[str, str]]", self.client.hgetall(self.keys.saved))
        return [SavedRecord.of(r) for r in records.values()]
