"""Bulk operations by label, an extension of the E2B API (under `/aenv/`, see docs/extensions.md):
kill, pause or set the timeout of every sandbox whose metadata matches a filter, and delete
every snapshot whose metadata (its sandbox's, when it was taken) matches one, in one call. A
crashed trainer's sandboxes go with one command (`aenv rm --metadata run=42`).

The filter is E2B's `metadata` query parameter, as `GET /v2/sandboxes` reads it
(`k1=v1&k2=v2`, URL-encoded), and is required: an empty one would match everything. Each
sandbox is handled as its own route would (concurrently), and reported on its own: its id,
and an `error` (`{code, message}`, the status its own route would answer) when it failed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.errors import APIError, call_lifecycle
from aenv.api.extensions import BULK_SANDBOXES, BULK_SNAPSHOTS
from aenv.api.models import TimeoutBody
from aenv.api.requests import check_query, parse_body
from aenv.api.sandboxes import matching, metadata_filter
from aenv.api.scope import team_of
from aenv.config import Config
from aenv.orchestrator.catalog import SandboxRecord
from aenv.orchestrator.kinds import SaveMode
from aenv.orchestrator.lifecycle import Orchestrator, SandboxNotFound


class BulkRoutes:
    def __init__(self, orchestrator: Orchestrator, config: Config) -> None:
        self.orc = orchestrator
        self.config = config

    def routes(self) -> list[Route]:
        return [
            Route(BULK_SANDBOXES + "/kill", self.kill, methods=["POST"]),
            Route(BULK_SANDBOXES + "/pause", self.pause, methods=["POST"]),
            Route(BULK_SANDBOXES + "/timeout", self.timeout, methods=["POST"]),
            Route(BULK_SNAPSHOTS, self.delete_snapshots, methods=["DELETE"]),
        ]

    def _selected(self, request: Request, public: frozenset[str]) -> list[SandboxRecord]:
        """The sandboxes the filter selects among those the API shows in state `public`."""
        check_query(request, {"metadata"})
        wanted = metadata_filter(request)
        if not wanted:
            raise APIError(400, "metadata: a filter is required (it would select everything)")
        team = team_of(request)
        shown = [r for r in self.orc.list() if r.state.public in public and r.team_id == team]
        return matching(shown, wanted)

    async def kill(self, request: Request) -> Response:
        """Kill every sandbox (running or paused) the filter selects."""
        selected = self._selected(request, frozenset({"running", "paused"}))
        return await _each(selected, self._kill)

    async def _kill(self, sandbox_id: str) -> None:
        if not await self.orc.kill(sandbox_id):
            raise SandboxNotFound(sandbox_id)  # killed meanwhile

    async def pause(self, request: Request) -> Response:
        """Pause, memory included, every running sandbox the filter selects."""
        selected = self._selected(request, frozenset({"running"}))

        async def pause(sandbox_id: str) -> None:
            await self.orc.pause(sandbox_id, mode=SaveMode.FULL)

        return await _each(selected, pause)

    async def timeout(self, request: Request) -> Response:
        """Every sandbox the filter selects now ends `timeout` seconds from now (E2B's
        `set_timeout`, for each)."""
        selected = self._selected(request, frozenset({"running", "paused"}))
        body = await parse_body(request, TimeoutBody)
        if body.timeout > self.config.max_timeout:
            raise APIError(400, f"timeout must be at most {self.config.max_timeout} seconds")

        async def set_timeout(sandbox_id: str) -> None:
            self.orc.set_timeout(sandbox_id, body.timeout)

        return await _each(selected, set_timeout)

    async def delete_snapshots(self, request: Request) -> Response:
        """Delete every snapshot whose metadata the filter selects (as `DELETE
        /templates/{id}` does: its files go once no sandbox uses them)."""
        check_query(request, {"metadata"})
        wanted = metadata_filter(request)
        if not wanted:
            raise APIError(400, "metadata: a filter is required (it would select everything)")
        team = team_of(request)
        selected = matching([s for s in self.orc.snapshots() if s.team_id == team], wanted)
        for snapshot in selected:
            await self.orc.delete_template(snapshot.template_id)
        return JSONResponse({"snapshots": [{"snapshotID": s.template_id} for s in selected]})


async def _each(
    selected: list[SandboxRecord], operation: Callable[[str], Awaitable[None]]
) -> Response:
    """Run `operation` on every selected sandbox at once; one entry per sandbox."""
    outcomes = await asyncio.gather(*(_outcome(r.id, operation) for r in selected))
    return JSONResponse({"sandboxes": outcomes})


async def _outcome(sandbox_id: str, operation: Callable[[str], Awaitable[None]]) -> dict[str, Any]:
    """`{"sandboxID"}`, with `error` when the operation failed as its own route would answer."""
    try:
        await call_lifecycle(operation(sandbox_id), sandbox_id)
    except APIError as e:
        return {"sandboxID": sandbox_id, "error": {"code": e.status, "message": e.message}}
    return {"sandboxID": sandbox_id}
