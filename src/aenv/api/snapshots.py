"""Routes that save or branch a sandbox's state: pause, resume, snapshots and fork, and this
node's batch fork (`POST /aenv/sandboxes/{id}/fork`, docs/extensions.md).

Snapshots are templates to the E2B API (an id from `POST /sandboxes/{id}/snapshots` is passed to
create as a template and deleted with `DELETE /templates/{id}`), so only their creation and
listing live here.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.errors import APIError, call_lifecycle
from aenv.api.extensions import BATCH_FORK
from aenv.api.internal_models import Refusal
from aenv.api.limits import wait_of
from aenv.api.models import (
    DEFAULT_TIMEOUT_V2,
    BatchForkBody,
    ForkBody,
    PauseBody,
    ResumeBody,
    SnapshotBody,
)
from aenv.api.queue import client_gone
from aenv.api.requests import check_query, parse_body
from aenv.api.sandboxes import MAX_PAGE, sandbox_body
from aenv.api.scope import team_of
from aenv.config import Config
from aenv.orchestrator.catalog import SandboxRecord
from aenv.orchestrator.fork import Child
from aenv.orchestrator.kinds import SaveMode
from aenv.orchestrator.lifecycle import (
    CapacityReached,
    CreateFailed,
    GuestUnhealthy,
    Orchestrator,
)
from aenv.orchestrator.templates import Template


def _snapshot_info(template: Template) -> dict[str, Any]:
    return {"snapshotID": template.template_id, "names": template.names}


class SnapshotRoutes:
    def __init__(self, orchestrator: Orchestrator, config: Config) -> None:
        self.orc = orchestrator
        self.config = config

    def routes(self) -> list[Route]:
        return [
            Route("/sandboxes/{sandbox_id}/pause", self.pause, methods=["POST"]),
            Route("/sandboxes/{sandbox_id}/resume", self.resume, methods=["POST"]),
            Route("/sandboxes/{sandbox_id}/snapshots", self.create_snapshot, methods=["POST"]),
            Route("/snapshots", self.list_snapshots, methods=["GET"]),
            Route("/sandboxes/{sandbox_id}/fork", self.fork, methods=["POST"]),
            Route(BATCH_FORK, self.fork_batch, methods=["POST"]),
        ]

    async def pause(self, request: Request) -> Response:
        """204 paused; 409 when it is not running (the SDK reads that as already paused); 503
        when `requireHealthyGuest` was asked and envd does not answer (it keeps running)."""
        check_query(request)
        body = await parse_body(request, PauseBody, optional=True)
        sandbox_id = request.path_params["sandbox_id"]
        pausing = self.orc.pause(
            sandbox_id, mode=SaveMode.of(body.memory), require_healthy=body.require_healthy_guest
        )
        try:
            await call_lifecycle(pausing, sandbox_id)
        except GuestUnhealthy as e:
            raise APIError(503, str(e), should_retry=False, refusal=Refusal.FAILED) from e
        return Response(status_code=204)

    async def resume(self, request: Request) -> Response:
        """The pre-`connect` route: 201 resumed; 409 when it is running already."""
        check_query(request)
        body = await parse_body(request, ResumeBody, optional=True)
        sandbox_id = request.path_params["sandbox_id"]
        timeout = body.timeout or DEFAULT_TIMEOUT_V2
        record, resumed = await call_lifecycle(
            self.orc.resume(sandbox_id, timeout, mode=SaveMode.of(body.memory)), sandbox_id
        )
        if not resumed:
            raise APIError(409, f"sandbox '{sandbox_id}' is already running")
        if body.auto_pause is not None:
            # What E2B does with it: the resumed sandbox's timeout now pauses (or kills) it.
            record = self.orc.set_auto_pause(sandbox_id, body.auto_pause)
        return JSONResponse(sandbox_body(record, self.config), status_code=201)

    async def create_snapshot(self, request: Request) -> Response:
        check_query(request)
        body = await parse_body(request, SnapshotBody, optional=True)
        sandbox_id = request.path_params["sandbox_id"]
        template = await call_lifecycle(
            self.orc.snapshot(sandbox_id, name=body.name, mode=SaveMode.of(body.memory)), sandbox_id
        )
        return JSONResponse(_snapshot_info(template), status_code=201)

    async def list_snapshots(self, request: Request) -> Response:
        """Newest first; `sandboxID` and `name` filter, `limit` + `nextToken` page."""
        check_query(request, {"sandboxID", "name", "limit", "nextToken"})
        q = request.query_params
        team = team_of(request)
        found = [t for t in self.orc.snapshots() if t.team_id == team]
        found.sort(key=lambda t: (t.created_at, t.template_id))
        found.reverse()
        if sandbox_id := q.get("sandboxID"):
            found = [t for t in found if t.source_sandbox_id == sandbox_id]
        if name := q.get("name"):  # a name (optionally `name:tag`) or an id
            wanted = name.split(":", 1)[0]
            found = [t for t in found if wanted in (*t.names, t.template_id)]
        try:
            limit = int(q.get("limit", MAX_PAGE))
        except ValueError as e:
            raise APIError(400, "limit must be an integer") from e
        if not 1 <= limit <= MAX_PAGE:
            raise APIError(400, f"limit must be between 1 and {MAX_PAGE}")
        if token := q.get("nextToken"):
            ids = [t.template_id for t in found]
            if token not in ids:
                raise APIError(400, "invalid nextToken")
            found = found[ids.index(token) + 1 :]
        page = found[:limit]
        headers = {"X-Next-Token": page[-1].template_id} if len(found) > limit else {}
        return JSONResponse([_snapshot_info(t) for t in page], headers=headers)

    async def fork(self, request: Request) -> Response:
        """201 with one entry per child: `{"sandbox": ...}` or `{"error": {code, message}}`."""
        check_query(request)
        body = await parse_body(request, ForkBody, optional=True)
        return await self._forked(request, body.timeout, [Child()] * body.count)

    async def fork_batch(self, request: Request) -> Response:
        """This node's extension: a fork whose every child adds its own metadata and env vars
        to the source's. Answered as `fork`, an entry per child in the order asked."""
        check_query(request)
        body = await parse_body(request, BatchForkBody)
        children = [Child(c.metadata or {}, c.env_vars or {}) for c in body.children]
        return await self._forked(request, body.timeout, children)

    async def _forked(self, request: Request, timeout: int, children: list[Child]) -> Response:
        sandbox_id = request.path_params["sandbox_id"]
        if timeout > self.config.max_timeout:
            raise APIError(400, f"timeout must be at most {self.config.max_timeout} seconds")
        owner = request.state.api_key.id
        wait = wait_of(request)
        try:
            async with client_gone(request, wait) as gone:
                forking = self.orc.fork_batch(
                    sandbox_id,
                    children,
                    timeout,
                    owner=owner,
                    team_id=team_of(request),
                    wait=wait,
                    gone=gone,
                )
                started = await call_lifecycle(forking, sandbox_id)
        except CapacityReached as e:  # the whole fork, refused before anything started
            raise APIError(
                429, str(e), error_code="sandbox_capacity_unavailable", refusal=Refusal.FULL
            ) from e
        return JSONResponse(fork_entries(started, self.config), status_code=201)


def fork_entries(
    children: list[SandboxRecord | BaseException], config: Config
) -> list[dict[str, Any]]:
    """E2B's fork answer: one entry per child, `{"sandbox": ...}` or `{"error": {code,
    message}}` (429 when the node had no room for it, 500 when its start failed)."""
    results: list[dict[str, Any]] = []
    for child in children:
        if isinstance(child, BaseException):
            status = 429 if isinstance(child, CapacityReached) else 500
            if not isinstance(child, CapacityReached | CreateFailed):
                raise child
            results.append({"error": {"code": status, "message": str(child)}})
        else:
            results.append({"sandbox": sandbox_body(child, config)})
    return results
