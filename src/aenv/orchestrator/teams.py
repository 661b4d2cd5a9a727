"""The node's teams: who owns what. Every API key belongs to one team, and every sandbox,
snapshot, template, volume, build, event, webhook and secret to the team of the key that made
it; a team sees only its own (and public templates).

A team is a row of the catalog's `teams` table (id, name, created). The default team,
`ids.TEAM_ID`, exists in every catalog (migration 5 makes it): what a node held before teams
belongs to it, as does the key a node generates at its first start. It cannot be deleted; another
team can once it owns nothing but keys (its keys go with it).
"""

from __future__ import annotations

import sqlite3
import time
import uuid
from dataclasses import dataclass

from aenv.ids import TEAM_ID
from aenv.orchestrator.catalog import Catalog


@dataclass(frozen=True)
class Team:
    id: str
    name: str
    created_at: float


class TeamNameTaken(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(f"a team named '{name}' already exists")


class TeamInUse(ValueError):
    """The team still owns sandboxes, templates or volumes, or is the default team."""


class TeamStore:
    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    def list(self) -> list[Team]:
        rows = self.catalog.db.execute("SELECT * FROM teams ORDER BY created_at, id")
        return [Team(**dict(row)) for row in rows]

    def get(self, team_id: str) -> Team | None:
        row = self.catalog.db.execute("SELECT * FROM teams WHERE id = ?", (team_id,)).fetchone()
        return Team(**dict(row)) if row else None

    async def named(self, team_id: str) -> str:
        """The team's name; its id for a team this node does not hold (a cluster's). Async as
        a cluster's teams are asked (`cluster.teams`)."""
        team = self.get(team_id)
        return team.name if team is not None else team_id

    def create(self, name: str) -> Team:
        """Raises `TeamNameTaken`."""
        team = Team(str(uuid.uuid4()), name, time.time())
        try:
            self.catalog.db.execute(
                "INSERT INTO teams (id, name, created_at) VALUES (?, ?, ?)",
                (team.id, team.name, team.created_at),
            )
        except sqlite3.IntegrityError as e:
            raise TeamNameTaken(name) from e
        return team

    def delete(self, team_id: str) -> bool:
        """False for an unknown team; raises `TeamInUse` for the default team or one that still
        owns sandboxes or volumes (its templates are the caller's to check)."""
        if team_id == TEAM_ID:
            raise TeamInUse("the default team cannot be deleted")
        with self.catalog.transaction() as db:
            for table in ("sandboxes", "volumes"):
                owned = db.execute(
                    f"SELECT 1 FROM {table} WHERE team_id = ? LIMIT 1",  # noqa: S608 - ours
                    (team_id,),
                ).fetchone()
                if owned is not None:
                    raise TeamInUse(f"team '{team_id}' still owns {table}: remove them first")
            cursor = db.execute("DELETE FROM teams WHERE id = ?", (team_id,))
        return cursor.rowcount == 1
