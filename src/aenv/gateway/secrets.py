"""Secrets across a cluster: E2B's `/secrets` routes, as one node answers them, over the
cluster's set in Redis (`aenv.cluster.secrets`), which every node mirrors and fills into its
sandboxes' header rules at egress. No answer, log line or Redis field holds a value in plain
text: the values are sealed before they are written."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.errors import APIError, not_found
from aenv.api.models import SecretUpdate
from aenv.api.requests import check_query, parse_body
from aenv.api.scope import team_of
from aenv.api.secrets import new_secret, page, secret_json
from aenv.cluster.directory import Directory
from aenv.cluster.secrets import ClusterSecrets, ConflictingWrites
from aenv.orchestrator.secrets import SecretNameTaken


class SecretRoutes:
    def __init__(self, directory: Directory) -> None:
        self.secrets = ClusterSecrets(directory.client, directory.secret, directory.registry.keys)

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
        return page(request, await self.secrets.list(team_of(request)))

    async def create(self, request: Request) -> Response:
        check_query(request)
        body = await new_secret(request)
        try:
            secret = await self.secrets.create(
                team_of(request), body.name, body.value, body.metadata or {}
            )
        except SecretNameTaken as e:
            raise APIError(409, str(e)) from e
        return JSONResponse(secret_json(secret), status_code=201)

    async def get(self, request: Request) -> Response:
        check_query(request)
        ref = request.path_params["secret_id"]
        secret = await self.secrets.get(team_of(request), ref)
        if secret is None:
            raise not_found(f"secret '{ref}'")
        return JSONResponse(secret_json(secret))

    async def update(self, request: Request) -> Response:
        check_query(request)
        ref = request.path_params["secret_id"]
        body = await parse_body(request, SecretUpdate)
        try:
            secret = await self.secrets.update(team_of(request), ref, body.value, body.metadata)
        except ConflictingWrites as e:
            raise APIError(409, str(e)) from e
        if secret is None:
            raise not_found(f"secret '{ref}'")
        return JSONResponse(secret_json(secret))

    async def delete(self, request: Request) -> Response:
        check_query(request)
        ref = request.path_params["secret_id"]
        try:
            deleted = await self.secrets.delete(team_of(request), ref)
        except ConflictingWrites as e:
            raise APIError(409, str(e)) from e
        if not deleted:
            raise not_found(f"secret '{ref}'")
        return Response(status_code=204)
