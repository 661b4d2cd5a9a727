"""Template builds through a gateway, as `Template.build` in the SDKs calls them.

- A build request (`POST /v3/templates`) is placed like a create: nodes holding the template
  (a rebuild) first, a published copy adopted by a node that lacks it (the rebuild then keeps
  the template's id), else a live node with room by load; a node that refuses or cannot be
  reached is skipped. The node it lands on is recorded for the template
  (`aenv.cluster.builds`).
- Every later call of the build (files, upload, start, status, logs) goes to that node: its
  build VM, uploads and log are there. The files answer names the gateway as the upload's
  destination, with the client's credentials, and uploads stream through.
- A build whose node is gone (its lease lapsed, or it cannot be reached) answers its status
  as `error` with the reason, so the SDK's poll ends instead of hanging; one the node finished
  and published answers `ready`. Its other calls are a 503 naming the node.
- Without a record (it expired, or Redis was wiped and the build's node has not heartbeated
  since: its agent records its builds in progress again) a status is answered by the first
  live node that knows the template, and the build's other calls are a 404.

A finished build is stored in the shared repository and published by its node like a snapshot
(`aenv.cluster.saved`), so a create from it works on every node. The status poll that sees it
ready records its node as holding it at once, so a create right after goes there first (and
another node's 404 for it is a refusal), before the node's next heartbeat publishes it.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.errors import APIError
from aenv.api.internal import caller_of
from aenv.api.scope import team_of
from aenv.cluster.holders import FileKind, FileRef
from aenv.cluster.registry import NodeReport
from aenv.gateway.nodes import Answer, NodeCalls, NodeFailed, NodeUnreachable
from aenv.gateway.saved import passed, target_of

_BUILD = "/templates/{template_id}/builds/{build_id}"
_FILES = "/templates/{template_id}/files/{hash}"


class BuildRoutes:
    def __init__(self, control: NodeCalls, first_knowing: Callable[[Request], Awaitable[Response]]):
        self.control = control
        self.directory = control.directory
        self.first_knowing = first_knowing

    def routes(self) -> list[Route]:
        return [
            Route("/v3/templates", self.request, methods=["POST"]),
            Route(_FILES, self.files, methods=["GET"]),
            Route(_FILES, self.upload, methods=["PUT"]),
            Route("/v2" + _BUILD, self.forward, methods=["POST"]),
            Route(_BUILD + "/status", self.status, methods=["GET"]),
            Route(_BUILD + "/logs", self.forward, methods=["GET"]),
        ]

    async def request(self, request: Request) -> Response:
        body = await request.body()
        name = _name_of(body)
        saved = await self.directory.saved.find(name, team_of(request)) if name else None
        holders = await self.directory.file_holders(saved.template_id) if saved else set()
        node, answer = await self.control.first_taker(
            request, target_of(request), body, "the build", saved, holders
        )
        if answer.status == 202:
            template_id = json.loads(answer.body)["templateID"]
            await self.directory.builds.place(template_id, node.node_id)
        return passed(answer)

    async def files(self, request: Request) -> Response:
        answer = await self._on_build_node(request, await request.body())
        if answer.status != 201:
            return passed(answer)
        found: dict[str, Any] = json.loads(answer.body)
        # The node named itself, which clients cannot reach: the upload comes here, also that
        # of files the node holds (a COPY step with `forceUpload` uploads them again).
        key = {k: v for k, v in request.headers.items() if k in ("x-api-key", "authorization")}
        found |= {"url": str(request.url.replace(query="")), "headers": key}
        return JSONResponse(found, status_code=201)

    async def upload(self, request: Request) -> Response:
        return passed(await self._on_build_node(request, request.stream()))

    async def forward(self, request: Request) -> Response:
        return passed(await self._on_build_node(request, await request.body()))

    async def status(self, request: Request) -> Response:
        template_id = unquote(request.path_params["template_id"])
        build_id = request.path_params["build_id"]
        node_id = await self.directory.builds.node_of(template_id)
        if node_id is None:
            return await self.first_knowing(request)
        node = await self.directory.registry.report(node_id)
        if node is not None:
            try:
                answer = await self._ask(request, node, b"")
            except (NodeUnreachable, NodeFailed):  # a read: the node is gone or going
                pass
            else:
                if answer.status == 200 and json.loads(answer.body).get("status") == "ready":
                    # Its node's next heartbeat says so too; a create right away needs it now.
                    await self.directory.holders.add(
                        node.node_id, FileRef(FileKind.TEMPLATE, template_id)
                    )
                return passed(answer)
        published = await self.directory.saved.find(template_id)
        if published is not None and published.build_id == build_id:
            return JSONResponse(_status(template_id, build_id, "ready"))
        reason = f"node {node_id}, which ran this build, is gone: build the template again"
        return JSONResponse(_status(template_id, build_id, "error", reason))

    async def _on_build_node(self, request: Request, body: Any) -> Answer:
        """The request on the node running the template's build; 404 when none is recorded,
        503 when that node is gone."""
        template_id = unquote(request.path_params["template_id"])
        node_id = await self.directory.builds.node_of(template_id)
        if node_id is None:
            raise APIError(404, f"no build of template '{template_id}' in this cluster")
        node = await self.directory.registry.report(node_id)
        gone = f"node {node_id}, which runs the build of template '{template_id}', is gone"
        if node is None:
            raise APIError(503, gone)
        try:
            return await self._call(request, node, body)
        except NodeUnreachable as error:
            raise APIError(503, f"{gone}: {error}") from error

    async def _call(self, request: Request, node: NodeReport, body: Any) -> Answer:
        try:
            return await self._ask(request, node, body)
        except NodeFailed as error:
            raise APIError(502, str(error), should_retry=False) from error

    async def _ask(self, request: Request, node: NodeReport, body: Any) -> Answer:
        return await self.control.nodes.call(
            node,
            request.method,
            target_of(request),
            caller=caller_of(request.state.api_key),
            headers=request.scope["headers"],
            body=body,
        )


def _status(template_id: str, build_id: str, status: str, reason: str = "") -> dict[str, Any]:
    """A build status as a node answers it (`aenv.api.builds.BuildRoutes.status`)."""
    body: dict[str, Any] = {
        "templateID": template_id,
        "buildID": build_id,
        "status": status,
        "logs": [],
        "logEntries": [],
    }
    if reason:
        body["reason"] = {"message": reason}
    return body


def _name_of(body: bytes) -> str:
    """The template a build request names, without its tag, for placement only: the node
    validates the body itself."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return ""
    value = (parsed.get("name") or parsed.get("alias")) if isinstance(parsed, dict) else None
    return value.split(":", 1)[0] if isinstance(value, str) else ""
