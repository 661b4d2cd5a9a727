"""The caller's team: `GET /teams`, as the E2B CLI reads it to pick the team it acts for, and
its metrics, `/teams/{teamID}/metrics` and `/teams/{teamID}/metrics/max`.

A key belongs to exactly one team, so `/teams` lists that one, `isDefault`; the key answered is
the one the caller sent (E2B's `Team.apiKey`). Another team's metrics answer 404, as any other
team's object does (E2B's spec allows a 403; a 404 says nothing of which teams exist).

Metrics (`orchestrator.team_metrics`) take `start` and `end` in Unix seconds (default: the hour
up to now); `end` before `start`, or a range longer than the events are kept, is a 400.
`metrics` answers E2B's `TeamMetric` points, one per step of the range; `metrics/max` its
`MaxTeamMetric` for `metric=concurrent_sandboxes` or `sandbox_start_rate`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.errors import APIError, not_found
from aenv.api.internal import caller
from aenv.api.requests import check_query, query_int
from aenv.api.sandboxes import rfc3339
from aenv.api.scope import team_of
from aenv.orchestrator.team_metrics import TeamMetrics, TeamPoint

DEFAULT_RANGE = 3600
METRICS = ("concurrent_sandboxes", "sandbox_start_rate")


class TeamRoutes:
    def __init__(
        self,
        name_of: Callable[[str], Awaitable[str]],
        metrics: TeamMetrics | None = None,
        retention_s: float = 0.0,
    ) -> None:
        """`name_of`: a team's name by its id (a node's catalog, or a cluster's Redis);
        `metrics`: where a team's are read (none: not served, as on a gateway); `retention_s`:
        how long events are kept."""
        self.name_of = name_of
        self.metrics = metrics
        self.retention_s = retention_s

    def routes(self) -> list[Route]:
        routes = [Route("/teams", self.teams, methods=["GET"])]
        if self.metrics is not None:
            routes += [
                Route("/teams/{team_id}/metrics", self.series, methods=["GET"]),
                Route("/teams/{team_id}/metrics/max", self.maximum, methods=["GET"]),
                # Not described: only a cluster's gateway calls it.
                Route(
                    "/teams/{team_id}/metrics/changes",
                    self.changes,
                    methods=["GET"],
                    include_in_schema=False,
                ),
            ]
        return routes

    async def teams(self, request: Request) -> Response:
        check_query(request)
        team = team_of(request)
        sent = request.headers.get("x-api-key") or request.headers["authorization"][7:]
        body = {"teamID": team, "name": await self.name_of(team), "apiKey": sent, "isDefault": True}
        return JSONResponse([body])

    def _range(self, request: Request, allowed: set[str]) -> tuple[str, int, int]:
        """The team (the caller's, else 404) and the range the query asks for."""
        team, start, end = metric_range(request, allowed)
        if end - start > self.retention_s:
            raise APIError(400, f"the range may span at most {self.retention_s:g} seconds")
        return team, start, end

    async def series(self, request: Request) -> Response:
        """`TeamMetric` points over the range."""
        team, start, end = self._range(request, {"start", "end"})
        assert self.metrics is not None  # routed only with them
        points = self.metrics.series(team, start, end)
        return JSONResponse([point_json(p) for p in points])

    async def maximum(self, request: Request) -> Response:
        """`MaxTeamMetric`: the highest value of `metric` over the range, and when."""
        team, start, end = self._range(request, {"start", "end", "metric"})
        metric = metric_of(request)
        assert self.metrics is not None  # routed only with them
        value: float
        if metric == "concurrent_sandboxes":
            value, at = self.metrics.max_concurrent(team, start, end)
        else:
            value, at = self.metrics.max_start_rate(team, start, end)
        return JSONResponse(max_json(value, at))

    async def changes(self, request: Request) -> Response:
        """For a cluster's gateway only (`aenv.gateway.team_metrics`): the team's sandboxes
        running at `start` and each change of their count up to `end`, for the cluster's
        maximum."""
        if caller(request.scope.get("state", {})) is None:
            raise not_found(request.url.path)
        team, start, end = self._range(request, {"start", "end"})
        assert self.metrics is not None  # routed only with them
        at_start, changes = self.metrics.changes(team, start, end)
        return JSONResponse({"atStart": at_start, "changes": changes})


def metric_range(request: Request, allowed: set[str]) -> tuple[str, int, int]:
    """The team a metrics query names (the caller's, else 404) and its range: `start` and `end`,
    the hour up to now by default."""
    check_query(request, allowed)
    team = request.path_params["team_id"]
    if team != team_of(request):
        raise not_found(f"team '{team}'")
    now = int(time.time())
    end = query_int(request, "end", now, 0, 2**62)
    start = query_int(request, "start", max(0, end - DEFAULT_RANGE), 0, 2**62)
    if end < start:
        raise APIError(400, "end must not be before start")
    return team, start, end


def metric_of(request: Request) -> str:
    """The `metric` a `metrics/max` query asks for."""
    metric = request.query_params.get("metric")
    if metric not in METRICS:
        raise APIError(400, f"metric must be one of {', '.join(METRICS)}")
    return metric


def point_json(point: TeamPoint) -> dict[str, Any]:
    """E2B's `TeamMetric`."""
    return {
        "timestamp": rfc3339(point.at),
        "timestampUnix": point.at,
        "concurrentSandboxes": point.concurrent,
        "sandboxStartRate": point.start_rate,
    }


def max_json(value: float, at: float) -> dict[str, Any]:
    """E2B's `MaxTeamMetric`."""
    return {"timestamp": rfc3339(at), "timestampUnix": int(at), "value": value}
