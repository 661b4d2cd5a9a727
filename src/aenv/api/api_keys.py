"""E2B's API key routes (`/api-keys`): list, create, rename and revoke the keys of a node (or of
a cluster, through a gateway). Anyone holding a key may manage the keys: a node or a cluster has
one team, its operator's."""

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
        return JSONResponse([team_api_key(key) for key in await self.keys.keys()])

    async def create(self, request: Request) -> Response:
        check_query(request)
        body = await parse_body(request, KeyName)
        key, value = await self.keys.new(body.name)
        return JSONResponse({**team_api_key(key), "key": value}, status_code=201)

    async def rename(self, request: Request) -> Response:
        check_query(request)
        body = await parse_body(request, KeyName)
        key_id = request.path_params["api_key_id"]
        try:
            await self.keys.rename(key_id, body.name)
        except KeyError as e:
            raise not_found(f"API key '{key_id}'") from e
        return Response(status_code=200)

    async def revoke(self, request: Request) -> Response:
        check_query(request)
        key_id = request.path_params["api_key_id"]
        try:
            await self.keys.revoke(key_id)
        except KeyError as e:
            raise not_found(f"API key '{key_id}'") from e
        except LastKey as e:
            raise APIError(400, str(e)) from e
        return Response(status_code=204)
