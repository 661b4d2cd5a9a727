"""E2B's API key routes (`/api-keys`): list, create, rename and revoke the keys of the caller's
team, on a node (or a cluster, through a gateway). Anyone holding a key of a team may manage
that team's keys, as in E2B; another team's keys are unknown ids (404). Teams themselves, and
their first keys, are the operator's (`api.admin`)."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, StringConstraints
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.errors import APIError, not_found
from aenv.api.keys import KEY_PREFIX, ApiKey, KeyBook, LastKey
from aenv.api.requests import check_query, parse_body
from aenv.api.sandboxes import rfc3339
from aenv.api.scope import team_of

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _printable(name: str) -> str:
    # Names are shown in terminals (`aenv keys list`) and logs: no C0, DEL or C1 characters.
    if _CONTROL.search(name):
        raise ValueError("must not contain control characters")
    return name


Name = Annotated[
    str,
    StringConstraints(strip_whitespace=True, min_length=1, max_length=200),
    AfterValidator(_printable),
]


class KeyName(BaseModel):
    """`NewTeamAPIKey` and `UpdateTeamAPIKey`: a name, nothing else."""

    model_config = ConfigDict(extra="forbid")
    name: Name


def team_api_key(key: ApiKey) -> dict[str, Any]:
    """The `TeamAPIKey` schema."""
    return {
        "id": key.id,
        "name": key.name,
        "mask": {
            "prefix": KEY_PREFIX,
            "valueLength": key.value_length,
            "maskedValuePrefix": key.masked_prefix,
            "maskedValueSuffix": key.masked_suffix,
        },
        "createdAt": rfc3339(key.created_at),
        "createdBy": None,
        "lastUsed": rfc3339(key.last_used) if key.last_used is not None else None,
    }


async def create_key(request: Request, keys: KeyBook, team_id: str) -> Response:
    """A key of the team, named by the body (`NewTeamAPIKey`): 201 with its value, shown this
    once. The `/api-keys` route and the operator's (`api.admin`, `gateway.admin`)."""
    body = await parse_body(request, KeyName)
    key, value = await keys.new(body.name, team_id)
    return JSONResponse({**team_api_key(key), "key": value}, status_code=201)


async def _check_team(keys: KeyBook, key_id: str, team_id: str) -> None:
    """404 unless `key_id` is a key of the team: another team's keys are unknown ids."""
    if not any(k.id == key_id and k.team_id == team_id for k in await keys.keys()):
        raise not_found(f"API key '{key_id}'")


async def revoke_key(keys: KeyBook, key_id: str, team_id: str) -> Response:
    """Revokes the team's key `key_id`: 204; 404 for no such key of the team (or one revoked
    meanwhile), 400 for the last key. The `/api-keys` route and the operator's."""
    await _check_team(keys, key_id, team_id)
    try:
        await keys.revoke(key_id)
    except KeyError as e:
        raise not_found(f"API key '{key_id}'") from e
    except LastKey as e:
        raise APIError(400, str(e)) from e
    return Response(status_code=204)


class ApiKeyRoutes:
    def __init__(self, keys: KeyBook) -> None:
        self.keys = keys

    def routes(self) -> list[Route]:
        return [
            Route("/api-keys", self.list, methods=["GET"]),
            Route("/api-keys", self.create, methods=["POST"]),
            Route("/api-keys/{api_key_id}", self.rename, methods=["PATCH"]),
            Route("/api-keys/{api_key_id}", self.revoke, methods=["DELETE"]),
        ]

    async def list(self, request: Request) -> Response:
        check_query(request)
        team = team_of(request)
        keys = [key for key in await self.keys.keys() if key.team_id == team]
        return JSONResponse([team_api_key(key) for key in keys])

    async def create(self, request: Request) -> Response:
        check_query(request)
        return await create_key(request, self.keys, team_of(request))

    async def rename(self, request: Request) -> Response:
        check_query(request)
        body = await parse_body(request, KeyName)
        key_id = request.path_params["api_key_id"]
        await _check_team(self.keys, key_id, team_of(request))
        try:
            await self.keys.rename(key_id, body.name)
        except KeyError as e:
            raise not_found(f"API key '{key_id}'") from e
        return Response(status_code=200)

    async def revoke(self, request: Request) -> Response:
        check_query(request)
        return await revoke_key(self.keys, request.path_params["api_key_id"], team_of(request))
