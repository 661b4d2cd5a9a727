"""E2B's sandbox lifecycle events API: `GET /events/sandboxes` (the team's events) and
`GET /events/sandboxes/{sandboxID}` (one sandbox's), with `offset`, `limit` (1-100, 10 by
default), `orderAsc` (newest first by default) and `types` (repeated: any of them).

A team sees only its own events; a sandbox of another team, or one never seen, has none (an
empty list, as for a sandbox whose events are past their retention)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.requests import check_query, query_enums, query_flag, query_int
from aenv.api.scope import team_of
from aenv.orchestrator.events import EventLog, EventQuery, EventType

MAX_LIMIT = 100
QUERY = ("offset", "limit", "orderAsc", "types")


def event_query(request: Request, sandbox_id: str | None) -> EventQuery:
    """The page a request asks for, or a 400 naming what is wrong with its query."""
    check_query(request, QUERY)
    return EventQuery(
        team_id=team_of(request),
        limit=query_int(request, "limit", 10, 1, MAX_LIMIT),
        offset=query_int(request, "offset", 0, 0, 2**62),
        ascending=query_flag(request, "orderAsc"),
        types=query_enums(request, "types", EventType, "types"),
        sandbox_id=sandbox_id,
    )


class EventRoutes:
    def __init__(self, events: EventLog) -> None:
        self.events = events

    def routes(self) -> list[Route]:
        return [
            Route("/events/sandboxes", self.team_events, methods=["GET"]),
            Route("/events/sandboxes/{sandbox_id}", self.sandbox_events, methods=["GET"]),
        ]

    def _page(self, request: Request, sandbox_id: str | None) -> Response:
        return JSONResponse(self.events.page(event_query(request, sandbox_id)))

    async def team_events(self, request: Request) -> Response:
        return self._page(request, None)

    async def sandbox_events(self, request: Request) -> Response:
        return self._page(request, request.path_params["sandbox_id"])
