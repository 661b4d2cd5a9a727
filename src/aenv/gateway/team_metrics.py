"""A team's metrics across a cluster: `/teams/{teamID}/metrics` and `/metrics/max`, as one node
answers them (`api.teams`), from every live node.

Each node reads its metrics from the lifecycle events of the sandboxes it ran. The gateway fixes
the range (its defaults, so every node cuts the same buckets), asks every live node for its
points and sums them point by point: the sandboxes of the team running at each point's time, and
its starts a second over the bucket. `metrics/max` for `sandbox_start_rate` is the top summed
point; for `concurrent_sandboxes` each node gives the team's sandboxes running at `start` and
every change of that count after (`/teams/{teamID}/metrics/changes`, a route only a gateway
reaches), which the gateway merges by time to find the cluster's peak, as one node finds its
own. A node's refusal (a range longer than its events are kept) is the client's answer; a live
node not answering fails the request (502) rather than give a sum without it.
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
from aenv.api.teams import max_json, metric_of, metric_range, point_json
from aenv.cluster.directory import Directory
from aenv.gateway.nodes import NodeFailed, NodeUnreachable
from aenv.gateway.saved import NodeCall, passed
from aenv.orchestrator.team_metrics import TeamPoint, peak


class TeamMetricRoutes:
    def __init__(self, directory: Directory, call: NodeCall) -> None:
        self.directory = directory
        self.call = call

    def routes(self) -> list[Route]:
        return [
            Route("/teams/{team_id}/metrics", self.series, methods=["GET"]),
            Route("/teams/{team_id}/metrics/max", self.maximum, methods=["GET"]),
        ]

    async def series(self, request: Request) -> Response:
        team, start, end = metric_range(request, {"start", "end"})
        answers = await self._ask(request, f"/teams/{team}/metrics", start, end)
        if isinstance(answers, Response):
            return answers
        return JSONResponse([point_json(p) for p in _summed(answers)])

    async def maximum(self, request: Request) -> Response:
        team, start, end = metric_range(request, {"start", "end", "metric"})
        metric = metric_of(request)
        if metric == "sandbox_start_rate":
            answers = await self._ask(request, f"/teams/{team}/metrics", start, end)
            if isinstance(answers, Response):
                return answers
            top = max(_summed(answers), key=lambda p: p.start_rate)
            return JSONResponse(max_json(top.start_rate, top.at))
        nodes = await self._ask(request, f"/teams/{team}/metrics/changes", start, end)
        if isinstance(nodes, Response):
            return nodes
        merged = heapq.merge(*([(float(t), int(c)) for t, c in n["changes"]] for n in nodes))
        value, at = peak(sum(int(n["atStart"]) for n in nodes), list(merged), start)
        return JSONResponse(max_json(value, at))

    async def _ask(self, request: Request, path: str, start: int, end: int) -> list[Any] | Response:
        """Every live node's answer, parsed; or the first refusal, as the client's answer."""
        target = f"{path}?{urlencode({'start': start, 'end': end})}"
        nodes = await self.directory.live()
        if not nodes:
            raise APIError(503, "no live node in the cluster")
        try:
            answers = await asyncio.gather(
                *(self.call(request, node, "GET", target, b"") for node in nodes)
            )
        except (NodeUnreachable, NodeFailed) as error:
            raise APIError(502, f"{path} on every node: {error}") from error
        for answer in answers:
            if answer.status != 200:
                return passed(answer)
        return [json.loads(a.body) for a in answers]


def _summed(answers: list[Any]) -> list[TeamPoint]:
    """The nodes' points summed by time (every node cut the same buckets)."""
    concurrent: dict[int, int] = {}
    rate: dict[int, float] = {}
    for points in answers:
        for point in points:
            at = int(point["timestampUnix"])
            concurrent[at] = concurrent.get(at, 0) + int(point["concurrentSandboxes"])
            rate[at] = rate.get(at, 0.0) + float(point["sandboxStartRate"])
    return [TeamPoint(at, concurrent[at], rate[at]) for at in sorted(concurrent)]
