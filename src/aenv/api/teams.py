"""`GET /teams`: the one team of a node, as the E2B CLI reads it to pick the team it acts for.
Every key of the node belongs to it; the key answered is the one the caller sent."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.requests import check_query
from aenv.ids import TEAM_ID


async def _teams(request: Request) -> Response:
    check_query(request)
    sent = request.headers.get("x-api-key") or request.headers["authorization"][len("bearer ") :]
    return JSONResponse([{"teamID": TEAM_ID, "name": TEAM_ID, "apiKey": sent, "isDefault": True}])


ROUTES = [Route("/teams", _teams, methods=["GET"])]
