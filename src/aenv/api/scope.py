"""Which team a request acts for, and the check that keeps every team to its own objects.

The API-key gate puts the caller's key in the request's state; its `team_id` is the team the
request acts for (`team_of`). Another team's sandbox, volume, snapshot or private template is
answered exactly as one that does not exist, 404 with the same message, never 403: ids do not
leak across teams.

`TeamScope.guard` applies that to every route by what its path names, in one place, so that no
route can forget it: a `{sandbox_id}` must be one of the team's sandboxes, a `{volume_id}` one
of its volumes. A sandbox or volume that does not exist is left to the route, which answers its
own 404. The same wrapper holds the routes that start sandboxes (`CREATES`) to the team's
`team_creates_per_s` (429 with `Retry-After` past it, before anything starts; a create that
may wait, `X-Aenv-Wait`, is held for its turn instead). Lists filter by
team in the routes that make them; template routes check the template (public ones are
readable by all, changed by their owner only).

The volume content API (`/volumecontent/...`) is outside: it takes the volume's own token, not an
API key, and only the owning team can read that token.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import cast

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from aenv.api.errors import APIError, not_found
from aenv.api.extensions import BATCH_FORK
from aenv.api.keys import ApiKey
from aenv.api.limits import RateLimiter, retry_after, wait_of
from aenv.api.volume_content import PREFIX as CONTENT_PREFIX
from aenv.orchestrator.capacity import disk_of
from aenv.orchestrator.lifecycle import Orchestrator
from aenv.orchestrator.volumes import VolumeNotFound

Endpoint = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class Caller:
    """Who makes a create: the key (recorded with the sandbox) and the team (its owner)."""

    key_id: str
    team_id: str


def team_of(request: Request) -> str:
    """The team the request acts for: its API key's."""
    return cast("ApiKey", request.state.api_key).team_id


def check_disk(orchestrator: Orchestrator, team_id: str, size_mb: int) -> None:
    """429 when a volume of `size_mb` would take the team past `team_max_disk_mb`."""
    limit = orchestrator.config.team_max_disk_mb
    used = disk_of(orchestrator.catalog, team_id)
    if used + size_mb > limit:
        raise APIError(
            429,
            f"this team's sandboxes and volumes hold {used} MiB of disk; {size_mb} MiB more"
            f" would pass its limit of {limit} MiB",
        )


# The routes that start sandboxes, by (path, method): a team's creates a second count them.
CREATES = frozenset(
    {
        ("/sandboxes", "POST"),
        ("/v2/sandboxes", "POST"),
        ("/sandboxes/{sandbox_id}/fork", "POST"),
        (BATCH_FORK, "POST"),
    }
)


class TeamScope:
    def __init__(self, orchestrator: Orchestrator, rate: float, max_wait: float = 0.0) -> None:
        """`rate`: `team_creates_per_s`; `max_wait`: the longest a create may wait its turn
        (`create_max_wait`)."""
        self.orc = orchestrator
        self.creates = RateLimiter(rate, max(1, math.ceil(rate)), max_wait)

    def check(self, request: Request) -> None:
        """404 when the path names another team's sandbox or volume."""
        team = team_of(request)
        params = request.path_params
        if "sandbox_id" in params:
            record = self.orc.catalog.get(params["sandbox_id"])
            if record is not None and record.team_id != team:
                raise not_found(f"sandbox '{params['sandbox_id']}'")
        if "volume_id" in params:
            try:
                volume = self.orc.volumes.get(params["volume_id"])
            except VolumeNotFound:
                return
            if volume.team_id != team:
                raise not_found(f"volume '{params['volume_id']}'")

    async def take_create(self, request: Request) -> None:
        """One of the team's `team_creates_per_s`: a create that may wait (`X-Aenv-Wait`) is
        held for its turn, up to its wait; 429 with `Retry-After` past it, or at once for one
        that may not wait."""
        team = team_of(request)
        held = self.creates.take(team, wait_of(request))
        if held is None:
            raise APIError(
                429,
                f"Rate limit exceeded: at most {self.creates.rate:g} sandbox creates a second"
                " per team",
                retry_after=int(retry_after(self.creates.retry_in(team))),
            )
        if held > 0:
            await asyncio.sleep(held)  # its turn in the team's rate

    def guard(self, routes: Iterable[BaseRoute]) -> list[BaseRoute]:
        """`routes`, each whose path names a sandbox or a volume checked first, and each that
        starts sandboxes counted."""
        guarded: list[BaseRoute] = []
        for route in routes:
            if isinstance(route, Route) and not route.path.startswith(CONTENT_PREFIX):
                names = {"sandbox_id", "volume_id"} & set(route.param_convertors)
                creates = any((route.path, m) in CREATES for m in route.methods or ())
                if names or creates:
                    route = Route(
                        route.path,
                        self._scoped(cast("Endpoint", route.endpoint), creates),
                        methods=route.methods,
                        name=route.name,
                    )
            guarded.append(route)
        return guarded

    def _scoped(self, endpoint: Endpoint, creates: bool) -> Endpoint:
        @functools.wraps(endpoint)
        async def scoped(request: Request) -> Response:
            self.check(request)
            if creates:
                await self.take_create(request)
            return await endpoint(request)

        return scoped
