"""The operator's routes across a cluster, as a node serves them (`api.admin`), behind the
cluster's admin token (`ClusterSecret.admin_token`, in `X-Admin-Token`), which is not an API key.

- Teams (`/aenv/admin/teams`) and their keys (`/admin/teams/{teamID}/api-keys`) are the
  cluster's, in Redis (`aenv.cluster.teams`, `aenv.cluster.keys`), so a key made through one
  gateway acts for its team through all.
- `POST /admin/teams/{teamID}/sandboxes/kill` and `.../builds/cancel` run on every live node (a
  lost node's paused sandboxes moved to a live one first, as for a bulk kill) and their counts
  are summed; `GET /admin/sandboxes/running-counts` sums every live node's. A gateway calls a
  node's admin routes with the cluster token for no user, which a node takes as its operator.
- Deleting a team is refused (409) while it owns anything, as on a node: sandboxes, volumes,
  templates or snapshots on any live node, or volumes and published templates and snapshots
  Redis records (`GET /aenv/admin/teams/{teamID}/holdings` lists them); its keys go with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from typing import Any
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.admin import (
    HOLDINGS,
    NewTeam,
    NoBody,
    admin_routes,
    check_admin_token,
    still_held,
    team_json,
)
from aenv.api.api_keys import create_key, revoke_key
from aenv.api.errors import APIError, not_found
from aenv.api.extensions import ADMIN_TEAMS as TEAMS
from aenv.api.requests import check_query, parse_body
from aenv.cluster.internal import CLUSTER_CALLER
from aenv.cluster.keys import ClusterKeys
from aenv.cluster.secret import ClusterSecret
from aenv.cluster.teams import ClusterTeams
from aenv.gateway.control import ControlPlane
from aenv.gateway.nodes import NodeFailed, NodeUnreachable
from aenv.ids import TEAM_ID
from aenv.orchestrator.teams import Team, TeamNameTaken


class AdminRoutes:
    def __init__(
        self,
        control: ControlPlane,
        keys: ClusterKeys,
        teams: ClusterTeams,
        secret: ClusterSecret,
    ) -> None:
        self.control = control
        self.keys = keys
        self.teams = teams
        self.digest = hashlib.sha256(secret.admin_token.encode()).hexdigest()

    def routes(self) -> list[Route]:
        return admin_routes(self, lambda request: check_admin_token(request, self.digest))

    async def _team(self, request: Request) -> Team:
        team_id = request.path_params["team_id"]
        team = await self.teams.get(team_id)
        if team is None:
            raise not_found(f"team '{team_id}'")
        return team

    async def list_teams(self, request: Request) -> Response:
        check_query(request)
        return JSONResponse([team_json(t) for t in await self.teams.list()])

    async def create_team(self, request: Request) -> Response:
        check_query(request)
        body = await parse_body(request, NewTeam)
        try:
            team = await self.teams.create(body.name)
        except TeamNameTaken as e:
            raise APIError(409, str(e)) from e
        return JSONResponse(team_json(team), status_code=201)

    async def _holdings(self, team_id: str) -> dict[str, list[str]]:
        """The ids of what the team owns across the cluster, by kind (`api.admin.HOLDINGS`):
        every live node's (a lost node's paused sandboxes moved to a live one first), with the
        volumes and the published templates and snapshots Redis records (those of lost nodes
        too)."""
        await self.control.move_lost()
        path = f"{TEAMS}/{quote(team_id, safe='')}/holdings"
        held: dict[str, set[str]] = {kind: set() for kind in HOLDINGS}
        for answer in await self._on_every_node("GET", path):
            for kind, ids in json.loads(answer).items():
                held.setdefault(kind, set()).update(ids)
        directory = self.control.directory
        held["volumes"].update(await directory.volumes.of_team(team_id))
        for record in await directory.saved.all():
            if record.team_id == team_id:
                kind = "snapshots" if record.kind == "snapshot" else "templates"
                held[kind].add(record.template_id)
        return {kind: sorted(ids) for kind, ids in held.items()}

    async def team_holdings(self, request: Request) -> Response:
        check_query(request)
        team = await self._team(request)
        return JSONResponse(await self._holdings(team.id))

    async def delete_team(self, request: Request) -> Response:
        """204; 409 for the default team, or naming what it still owns on any node or in
        Redis (sandboxes, volumes, templates, snapshots), as a node refuses it."""
        check_query(request)
        team = await self._team(request)
        if team.id == TEAM_ID:
            raise APIError(409, "the default team cannot be deleted")
        refused = still_held(team.id, await self._holdings(team.id))
        if refused is not None:
            raise refused
        await self.teams.delete(team.id)
        for key in await self.keys.keys():
            if key.team_id == team.id:
                with contextlib.suppress(KeyError):  # revoked meanwhile
                    await self.keys.revoke(key.id)
        return Response(status_code=204)

    async def create_key(self, request: Request) -> Response:
        check_query(request)
        return await create_key(request, self.keys, (await self._team(request)).id)

    async def revoke_key(self, request: Request) -> Response:
        check_query(request)
        team = await self._team(request)
        return await revoke_key(self.keys, request.path_params["api_key_id"], team.id)

    async def kill_sandboxes(self, request: Request) -> Response:
        check_query(request)
        await parse_body(request, NoBody, optional=True)
        team = await self._team(request)
        await self.control.move_lost()
        path = f"/admin/teams/{quote(team.id, safe='')}/sandboxes/kill"
        answers = [json.loads(b) for b in await self._on_every_node("POST", path)]
        self.control.freed()
        return JSONResponse(_summed(answers, ("killedCount", "failedCount")))

    async def cancel_builds(self, request: Request) -> Response:
        check_query(request)
        await parse_body(request, NoBody, optional=True)
        team = await self._team(request)
        path = f"/admin/teams/{quote(team.id, safe='')}/builds/cancel"
        answers = [json.loads(b) for b in await self._on_every_node("POST", path)]
        return JSONResponse(_summed(answers, ("cancelledCount", "failedCount")))

    async def running_counts(self, request: Request) -> Response:
        check_query(request)
        answers = await self._on_every_node("GET", "/admin/sandboxes/running-counts")
        counts: dict[str, int] = {}
        for answer in answers:
            for team_id, count in json.loads(answer).items():
                counts[team_id] = counts.get(team_id, 0) + int(count)
        return JSONResponse(counts)

    async def _on_every_node(
        self, method: str, target: str, caller: str = CLUSTER_CALLER
    ) -> list[bytes]:
        """Every live node's answer to the call (as the operator, unless `caller` names a team);
        a node not answering, or answering an error, fails the request (502): a count without
        it would be wrong."""
        nodes = await self.control.directory.live()
        calls = [self.control.nodes.call(n, method, target, caller=caller) for n in nodes]
        try:
            answers = await asyncio.gather(*calls)
        except (NodeUnreachable, NodeFailed) as error:
            raise APIError(502, f"{target} on every node: {error}") from error
        for node, answer in zip(nodes, answers, strict=True):
            if answer.status >= 400:
                raise APIError(502, f"{target} on node {node.node_id}: {answer.status}")
        return [a.body for a in answers]


def _summed(answers: list[dict[str, Any]], fields: tuple[str, ...]) -> dict[str, int]:
    return {f: sum(int(a[f]) for a in answers) for f in fields}
