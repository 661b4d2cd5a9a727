"""The routes a third party verifies workload identity tokens with (`network.identity`): the
OIDC discovery document at the issuer's `/.well-known/openid-configuration` and the JWKS it
points to. Open to anyone, without an API key: they hold public keys only."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.requests import check_query
from aenv.network.identity import DISCOVERY_PATH, JWKS_PATH, Signer

OPEN_PATHS = frozenset({DISCOVERY_PATH, JWKS_PATH})


class IdentityRoutes:
    def __init__(self, signer: Signer) -> None:
        self.signer = signer

    def routes(self) -> list[Route]:
        return [
            Route(DISCOVERY_PATH, self.discovery, methods=["GET"]),
            Route(JWKS_PATH, self.jwks, methods=["GET"]),
        ]

    async def discovery(self, request: Request) -> Response:
        check_query(request)
        return JSONResponse(self.signer.discovery())

    async def jwks(self, request: Request) -> Response:
        check_query(request)
        return JSONResponse(self.signer.jwks())
