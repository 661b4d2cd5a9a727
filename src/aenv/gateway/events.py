"""Lifecycle events across a cluster: `GET /events/sandboxes` and `/events/sandboxes/{id}`, as
one node answers them, from every live node.

Each node keeps the events of the sandboxes it ran, in its catalog (`orchestrator.events`); a
sandbox moved between nodes has some on each. The gateway asks every live node for the first
`offset + limit` events matching the query (page by page, `MAX_LIMIT` at a time), merges them by
time (each node's own order kept: two events of one second stay as their node wrote them) and
answers the page asked for. The window is bounded (`MAX_WINDOW`): a deeper page is a 400.
The events of a node that is gone are not served: they are in its catalog, not in the cluster.

`GET /events/nodes` (this cluster's own, for operators) lists the nodes' events
(`aenv.cluster.node_events`: drained, undrained, failed, back), newest first, `limit` of them
(1-100, 10 by default), of one node with `node`.
"""

from __future__ import annotations

import asyncio
import heapq
import json
from typing import Any
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.errors import APIError
from aenv.api.events import MAX_LIMIT, event_query
from aenv.api.requests import check_query, query_int
from aenv.cluster.directory import Directory
from aenv.cluster.registry import NodeReport
from aenv.gateway.nodes import NodeUnreachable, message
from aenv.gateway.saved import NodeCall
from aenv.orchestrator.events import EventQuery

# `offset + limit` a gateway gathers from each node at most.
MAX_WINDOW = 10_000


class EventRoutes:
    def __init__(self, directory: Directory, call: NodeCall) -> None:
        self.directory = directory
        self.call = call

    def routes(self) -> list[Route]:
        return [
            Route("/events/sandboxes", self.team_events, methods=["GET"]),
            Route("/events/sandboxes/{sandbox_id}", self.sandbox_events, methods=["GET"]),
            Route("/events/nodes", self.node_events, methods=["GET"]),
        ]

    async def node_events(self, request: Request) -> Response:
        check_query(request, ("limit", "node"))
        events = await self.directory.node_events.list(
            query_int(request, "limit", 10, 1, MAX_LIMIT), request.query_params.get("node")
        )
        return JSONResponse([e.to_json() for e in events])

    async def team_events(self, request: Request) -> Response:
        return await self._merged(request, request.url.path, event_query(request, None))

    async def sandbox_events(self, request: Request) -> Response:
        query = event_query(request, request.path_params["sandbox_id"])
        return await self._merged(request, request.url.path, query)

    async def _merged(self, request: Request, path: str, query: EventQuery) -> Response:
        window = query.offset + query.limit
        if window > MAX_WINDOW:
            raise APIError(400, f"offset + limit is at most {MAX_WINDOW} through a gateway")
        nodes = await self.directory.live()
        lists = await asyncio.gather(*(self._first(request, n, path, query, window) for n in nodes))
        merged = heapq.merge(*lists, key=lambda e: str(e["timestamp"]), reverse=not query.ascending)
        return JSONResponse(list(merged)[query.offset : window])

    async def _first(
        self, request: Request, node: NodeReport, path: str, query: EventQuery, count: int
    ) -> list[dict[str, Any]]:
        """The node's first `count` events of the query, in its order."""
        events: list[dict[str, Any]] = []
        while len(events) < count:
            params: list[tuple[str, str]] = [
                ("offset", str(len(events))),
                ("limit", str(min(MAX_LIMIT, count - len(events)))),
                ("orderAsc", "true" if query.ascending else "false"),
                *(("types", t.value) for t in query.types),
            ]
            try:
                answer = await self.call(request, node, "GET", f"{path}?{urlencode(params)}", b"")
            except NodeUnreachable as error:
                raise APIError(502, str(error)) from error
            if answer.status != 200:
                raise APIError(answer.status, message(answer))
            page = json.loads(answer.body)
            events += page
            if len(page) < MAX_LIMIT:
                break
        return events
