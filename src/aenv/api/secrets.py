"""E2B's secret routes: `/secrets` (list, create) and `/secrets/{secretID}` (get, update,
delete), scoped to the caller's team. A secret is named by its id or its name in any case.

No response carries a value: a secret's value leaves the node only in the requests the
egress proxy sends for a header rule naming it (`network.header_rules`).

The same routes serve a node, over its store (`orchestrator.secrets`, behind `NodeSecrets`),
and a gateway, over the cluster's set in Redis (`cluster.secrets`): both are `Secrets`."""

from __future__ import annotations

import builtins
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.errors import APIError, not_found
from aenv.api.models import NewSecret, SecretUpdate
from aenv.api.requests import check_query, parse_body, query_int
from aenv.api.scope import team_of
from aenv.orchestrator.events import timestamp
from aenv.orchestrator.secrets import ID_PREFIX, SecretNameTaken, SecretRecord, SecretStore

MAX_PAGE = 100


def secret_json(secret: SecretRecord) -> dict[str, Any]:
    return {
        "secretID": secret.secret_id,
        "name": secret.name,
        "currentVersion": secret.current_version,
        "metadata": secret.metadata,
        "createdAt": timestamp(secret.created_at),
        "updatedAt": timestamp(secret.updated_at),
    }


def page(request: Request, found: list[SecretRecord]) -> Response:
    """A page of `found` (oldest first): `limit` and `nextToken` page (the token is the last
    one's id)."""
    limit = query_int(request, "limit", MAX_PAGE, 1, MAX_PAGE)
    if token := request.query_params.get("nextToken"):
        ids = [s.secret_id for s in found]
        if token not in ids:
            raise APIError(400, "invalid nextToken")
        found = found[ids.index(token) + 1 :]
    shown = found[:limit]
    headers = {"X-Next-Token": shown[-1].secret_id} if len(found) > limit else {}
    return JSONResponse([secret_json(s) for s in shown], headers=headers)


async def new_secret(request: Request) -> NewSecret:
    """The body of a create, its name checked not to look like an id."""
    body = await parse_body(request, NewSecret)
    if body.name.lower().startswith(ID_PREFIX):
        raise APIError(400, f"name: the '{ID_PREFIX}' prefix is reserved for secret ids")
    return body


class Secrets(Protocol):
    """A team's secrets as the routes use them; `ref` is a secret's id or its name in any
    case. `create` raises SecretNameTaken, and nothing is stored then; a store's own failures
    (a cluster's `ConflictingWrites`) are the app's exception handlers' to answer."""

    async def list(self, team_id: str) -> builtins.list[SecretRecord]: ...

    async def create(
        self, team_id: str, name: str, value: str, metadata: dict[str, str]
    ) -> SecretRecord: ...

    async def get(self, team_id: str, ref: str) -> SecretRecord | None: ...

    async def update(
        self, team_id: str, ref: str, value: str, metadata: dict[str, str] | None
    ) -> SecretRecord | None: ...

    async def delete(self, team_id: str, ref: str) -> bool: ...


class NodeSecrets:
    """A node's store as `Secrets`: its calls are short SQLite transactions, made in place."""

    def __init__(self, store: SecretStore) -> None:
        self.store = store

    async def list(self, team_id: str) -> builtins.list[SecretRecord]:
        return self.store.list(team_id)

    async def create(
        self, team_id: str, name: str, value: str, metadata: dict[str, str]
    ) -> SecretRecord:
        return self.store.create(team_id, name, value, metadata)

    async def get(self, team_id: str, ref: str) -> SecretRecord | None:
        return self.store.get(team_id, ref)

    async def update(
        self, team_id: str, ref: str, value: str, metadata: dict[str, str] | None
    ) -> SecretRecord | None:
        return self.store.update(team_id, ref, value, metadata)

    async def delete(self, team_id: str, ref: str) -> bool:
        return self.store.delete(team_id, ref)


class SecretRoutes:
    def __init__(self, store: Secrets) -> None:
        self.store = store

    def routes(self) -> list[Route]:
        one = "/secrets/{secret_id}"
        return [
            Route("/secrets", self.list, methods=["GET"]),
            Route("/secrets", self.create, methods=["POST"]),
            Route(one, self.get, methods=["GET"]),
            Route(one, self.update, methods=["POST"]),
            Route(one, self.delete, methods=["DELETE"]),
        ]

    async def list(self, request: Request) -> Response:
        check_query(request, {"limit", "nextToken"})
        return page(request, await self.store.list(team_of(request)))

    async def create(self, request: Request) -> Response:
        check_query(request)
        body = await new_secret(request)
        try:
            secret = await self.store.create(
                team_of(request), body.name, body.value, body.metadata or {}
            )
        except SecretNameTaken as e:
            raise APIError(409, str(e)) from e
        return JSONResponse(secret_json(secret), status_code=201)

    async def get(self, request: Request) -> Response:
        check_query(request)
        ref = request.path_params["secret_id"]
        secret = await self.store.get(team_of(request), ref)
        if secret is None:
            raise not_found(f"secret '{ref}'")
        return JSONResponse(secret_json(secret))

    async def update(self, request: Request) -> Response:
        check_query(request)
        ref = request.path_params["secret_id"]
        body = await parse_body(request, SecretUpdate)
        secret = await self.store.update(team_of(request), ref, body.value, body.metadata)
        if secret is None:
            raise not_found(f"secret '{ref}'")
        return JSONResponse(secret_json(secret))

    async def delete(self, request: Request) -> Response:
        check_query(request)
        ref = request.path_params["secret_id"]
        if not await self.store.delete(team_of(request), ref):
            raise not_found(f"secret '{ref}'")
        return Response(status_code=204)
