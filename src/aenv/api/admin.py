"""The operator's routes: teams and their keys, and E2B's admin routes, behind the operator's
credential, which is not an API key.

The credential is a random token in `$AENV_HOME/admin-token` (mode 0600), written at the node's
first start, sent as E2B's `X-Admin-Token` header (its `AdminApiKeyAuth`). Only who can read the
node's data directory holds it, so it is the operator's, as the node's first API key file is;
no API key reaches these routes, and the token reaches no other route. The node keeps only its
SHA-256 and compares in constant time.

In a cluster, a gateway serves these routes with the cluster's admin token
(`aenv.gateway.admin`) and calls a node's with the cluster token for no user (`api.internal`):
such a call needs no admin token, and names any team of the cluster, which the node need not hold.

Routes, every one answering 401 without the token and 404 for a team the node does not hold:

- E2B's: `POST /admin/teams/{teamID}/api-keys` (a key of the team: `CreatedTeamAPIKey`),
  `DELETE /admin/teams/{teamID}/api-keys/{apiKeyID}`, `POST /admin/teams/{teamID}/sandboxes/kill`
  (`AdminSandboxKillResult`), `POST /admin/teams/{teamID}/builds/cancel`
  (`AdminBuildCancelResult`), `GET /admin/sandboxes/running-counts` (running sandboxes by team,
  teams without any left out).
- This node's, as E2B has no route for them: `GET /aenv/admin/teams` (id, name, created),
  `POST /aenv/admin/teams` `{"name"}` (201), `DELETE /aenv/admin/teams/{teamID}` (204; 409 naming
  what the team still owns, sandboxes, volumes, templates or snapshots, or for the default team;
  its keys go with it), `GET /aenv/admin/teams/{teamID}/holdings` (the ids of each kind it owns).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import os
import secrets
from collections.abc import Awaitable, Callable, Collection, Mapping
from pathlib import Path
from typing import Protocol, cast

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.api_keys import Name, create_key, revoke_key
from aenv.api.errors import APIError, not_found
from aenv.api.extensions import ADMIN_HEADER
from aenv.api.extensions import ADMIN_TEAMS as TEAMS
from aenv.api.internal import by_operator
from aenv.api.keys import KeyStore, LocalKeys
from aenv.api.requests import check_query, parse_body
from aenv.api.sandboxes import rfc3339
from aenv.ids import TEAM_ID
from aenv.orchestrator.builds import Builder
from aenv.orchestrator.lifecycle import Orchestrator
from aenv.orchestrator.teams import Team, TeamInUse, TeamNameTaken, TeamStore

Endpoint = Callable[[Request], Awaitable[Response]]


def open_admin_token(path: Path) -> str:
    """The SHA-256 of the node's admin token, generating the token (0600) at the first start."""
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        token = ""
    if not token:
        token = "aenv_admin_" + secrets.token_hex(24)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
    return hashlib.sha256(token.encode()).hexdigest()


class NewTeam(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Name


class NoBody(BaseModel):
    """What the routes that take no body accept: nothing (an empty body, or `{}`)."""

    model_config = ConfigDict(extra="forbid")


def check_admin_token(request: Request, digest: str) -> None:
    """Raises a 401 unless the request carries the token whose SHA-256 is `digest`."""
    given = request.headers.get(ADMIN_HEADER, "").strip()
    if not given or not hmac.compare_digest(
        hashlib.sha256(given.encode()).hexdigest().encode(), digest.encode()
    ):
        raise APIError(401, "the admin token is required: X-Admin-Token")


def team_json(team: Team) -> dict[str, str]:
    return {"teamID": team.id, "name": team.name, "createdAt": rfc3339(team.created_at)}


# What a team may own that keeps it from being deleted, in the order a refusal names them.
HOLDINGS = ("sandboxes", "volumes", "templates", "snapshots")


def still_held(team_id: str, holdings: Mapping[str, Collection[str]]) -> APIError | None:
    """The 409 refusing to delete a team that still owns something, naming how many of each
    kind; None when it owns nothing."""
    held = [f"{len(holdings[kind])} {kind}" for kind in HOLDINGS if holdings.get(kind)]
    if not held:
        return None
    return APIError(409, f"team '{team_id}' still owns {', '.join(held)}: remove them first")


class AdminEndpoints(Protocol):
    """The operator's routes, as a node (here) or a gateway (`gateway.admin`) answers them."""

    async def list_teams(self, request: Request) -> Response: ...
    async def create_team(self, request: Request) -> Response: ...
    async def delete_team(self, request: Request) -> Response: ...
    async def team_holdings(self, request: Request) -> Response: ...
    async def create_key(self, request: Request) -> Response: ...
    async def revoke_key(self, request: Request) -> Response: ...
    async def kill_sandboxes(self, request: Request) -> Response: ...
    async def cancel_builds(self, request: Request) -> Response: ...
    async def running_counts(self, request: Request) -> Response: ...


def admin_routes(endpoints: AdminEndpoints, check: Callable[[Request], None]) -> list[Route]:
    """The operator's routes, each behind `check` (which raises unless the caller is the
    operator)."""
    team = "/admin/teams/{team_id}"
    plain = [
        Route(TEAMS, endpoints.list_teams, methods=["GET"]),
        Route(TEAMS, endpoints.create_team, methods=["POST"]),
        Route(TEAMS + "/{team_id}", endpoints.delete_team, methods=["DELETE"]),
        Route(TEAMS + "/{team_id}/holdings", endpoints.team_holdings, methods=["GET"]),
        Route(team + "/api-keys", endpoints.create_key, methods=["POST"]),
        Route(team + "/api-keys/{api_key_id}", endpoints.revoke_key, methods=["DELETE"]),
        Route(team + "/sandboxes/kill", endpoints.kill_sandboxes, methods=["POST"]),
        Route(team + "/builds/cancel", endpoints.cancel_builds, methods=["POST"]),
        Route("/admin/sandboxes/running-counts", endpoints.running_counts, methods=["GET"]),
    ]
    return [
        Route(r.path, _checked(cast("Endpoint", r.endpoint), check), methods=r.methods)
        for r in plain
    ]


def _checked(endpoint: Endpoint, check: Callable[[Request], None]) -> Endpoint:
    async def checked(request: Request) -> Response:
        check(request)
        return await endpoint(request)

    return functools.wraps(endpoint)(checked)


class AdminRoutes:
    def __init__(
        self,
        orchestrator: Orchestrator,
        builder: Builder,
        keys: KeyStore,
        teams: TeamStore,
        token_digest: str,
    ) -> None:
        self.orc = orchestrator
        self.builder = builder
        self.keys = keys
        self.book = LocalKeys(keys)
        self.teams = teams
        self.digest = token_digest

    def routes(self) -> list[Route]:
        return admin_routes(self, self._check)

    def _check(self, request: Request) -> None:
        if not by_operator(request.scope.get("state", {})):
            check_admin_token(request, self.digest)

    def _team(self, request: Request) -> Team:
        team_id = request.path_params["team_id"]
        team = self.teams.get(team_id)
        if team is None and by_operator(request.scope.get("state", {})):
            return Team(team_id, team_id, 0.0)  # the cluster's: its gateways know its teams
        if team is None:
            raise not_found(f"team '{team_id}'")
        return team

    async def list_teams(self, request: Request) -> Response:
        check_query(request)
        return JSONResponse([team_json(t) for t in self.teams.list()])

    async def create_team(self, request: Request) -> Response:
        check_query(request)
        body = await parse_body(request, NewTeam)
        try:
            team = self.teams.create(body.name)
        except TeamNameTaken as e:
            raise APIError(409, str(e)) from e
        return JSONResponse(team_json(team), status_code=201)

    def _holdings(self, team_id: str) -> dict[str, list[str]]:
        """The ids of each kind of thing (`HOLDINGS`) the team owns on this node."""
        catalog, templates = self.orc.catalog, self.orc.templates
        return {
            "sandboxes": [r.id for r in catalog.list() if r.team_id == team_id and not r.internal],
            "volumes": [v.id for v in catalog.volumes(team_id)],
            "templates": [t.template_id for t in templates.list() if t.team_id == team_id],
            "snapshots": [s.template_id for s in self.orc.snapshots() if s.team_id == team_id],
        }

    async def team_holdings(self, request: Request) -> Response:
        """What the team owns here, the ids by kind: what keeps it from being deleted (a
        cluster's gateway joins every node's before it deletes a team)."""
        check_query(request)
        return JSONResponse(self._holdings(self._team(request).id))

    async def delete_team(self, request: Request) -> Response:
        """204; 409 naming what it still owns (sandboxes, volumes, templates, snapshots), or
        for the default team."""
        check_query(request)
        team = self._team(request)
        refused = still_held(team.id, self._holdings(team.id))
        if refused is not None and team.id != TEAM_ID:
            raise refused
        try:
            self.teams.delete(team.id)
        except TeamInUse as e:
            raise APIError(409, str(e)) from e
        self.keys.revoke_team(team.id)
        return Response(status_code=204)

    async def create_key(self, request: Request) -> Response:
        check_query(request)
        return await create_key(request, self.book, self._team(request).id)

    async def revoke_key(self, request: Request) -> Response:
        check_query(request)
        team = self._team(request)
        return await revoke_key(self.book, request.path_params["api_key_id"], team.id)

    async def kill_sandboxes(self, request: Request) -> Response:
        """Every sandbox of the team, running or paused."""
        check_query(request)
        await parse_body(request, NoBody, optional=True)
        team = self._team(request)
        shown = [r for r in self.orc.list() if r.team_id == team.id and r.state.public]
        killed = await asyncio.gather(*(self.orc.kill(r.id) for r in shown))
        return JSONResponse({"killedCount": sum(killed), "failedCount": len(killed) - sum(killed)})

    async def cancel_builds(self, request: Request) -> Response:
        check_query(request)
        await parse_body(request, NoBody, optional=True)
        team = self._team(request)
        cancelled, failed = await self.builder.cancel_team(team.id)
        return JSONResponse({"cancelledCount": cancelled, "failedCount": failed})

    async def running_counts(self, request: Request) -> Response:
        check_query(request)
        counts: dict[str, int] = {}
        for record in self.orc.list():
            if record.state.public == "running" and not record.internal:
                counts[record.team_id] = counts.get(record.team_id, 0) + 1
        return JSONResponse(counts)
