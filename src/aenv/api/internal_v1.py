"""A node's internal API, version 1 (`internal_models`): typed calls of a gateway, each run
through the node's own E2B route in process and answered as a `NodeAnswer`.

Running a call through its E2B route keeps one home for every operation: the call is checked,
done and answered exactly as a client of the node's public API would see it, and the gateway
passes that answer on unchanged. What this layer adds is the kind of a refusal, which the
route's error recorded in the request's state (`api.internal.record_refusal`), so the gateway
need not guess it from a status code.

`aenv.cluster.internal.InternalGate` authenticates these calls with the cluster token and
sends them here with the prefix stripped (`/v1/...`); a call it let through names the API key
the gateway acts for (`api.internal.caller`), as a replayed request does.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from enum import StrEnum
from typing import Any, TypeVar
from urllib.parse import urlencode

from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Scope

from aenv.api.app import JSON_ERRORS
from aenv.api.errors import APIError
from aenv.api.idempotency import HEADER as IDEMPOTENCY_HEADER
from aenv.api.internal import CALLER_STATE, REFUSAL_STATE
from aenv.api.internal_models import (
    ADOPT_ROUTES,
    BUILD_ROUTES,
    BUILDS_ROUTE,
    CREATE_ROUTES,
    FILES_ROUTE,
    LIST_ROUTES,
    METRICS_ROUTE,
    PREFIX_V1,
    SANDBOX_ROUTES,
    TAG_ROUTES,
    TEMPLATE_ROUTES,
    VOLUME_ROUTES,
    VOLUMES_ROUTE,
    Adopt,
    AdoptKind,
    BuildCall,
    BuildOp,
    CreateSandbox,
    CreateVolume,
    FilesCall,
    ListCall,
    ListOp,
    Metrics,
    NodeAnswer,
    Refusal,
    RequestBuild,
    SandboxCall,
    SandboxOp,
    TagCall,
    TagOp,
    TemplateCall,
    TemplateOp,
    VolumeCall,
    VolumeOp,
)
from aenv.api.requests import check_query, parse_body

M = TypeVar("M", bound=BaseModel)
E = TypeVar("E", bound=StrEnum)
# Headers of the E2B answer the node's server sets again on the answer to the gateway.
_SET_AGAIN = frozenset({"content-length"})


def internal_v1(app: ASGIApp, draining: Callable[[], bool] = lambda: False) -> ASGIApp:
    """The version 1 routes (paths under `PREFIX_V1`) over the node's app `app`; creates are
    refused as `DRAINING` while `draining()` (the node's memory of its drain, as of its last
    heartbeat: a gateway that read the drain before it began may still send one)."""
    calls = _Calls(app, draining)
    return Starlette(
        routes=[
            Route(PREFIX_V1 + "/sandboxes", calls.create, methods=["POST"]),
            Route(PREFIX_V1 + "/sandboxes/{sandbox_id}/{op}", calls.sandbox, methods=["POST"]),
            Route(PREFIX_V1 + "/templates/{template_id}/{op}", calls.template, methods=["POST"]),
            Route(PREFIX_V1 + "/builds", calls.request_build, methods=["POST"]),
            Route(
                PREFIX_V1 + "/templates/{template_id}/builds/{build_id}/{op}",
                calls.build,
                methods=["POST"],
            ),
            Route(
                PREFIX_V1 + "/templates/{template_id}/files/{hash}", calls.files, methods=["POST"]
            ),
            Route(PREFIX_V1 + "/tags/{op}", calls.tags, methods=["POST"]),
            Route(PREFIX_V1 + "/lists/{op}", calls.lists, methods=["POST"]),
            Route(PREFIX_V1 + "/metrics", calls.metrics, methods=["POST"]),
            Route(PREFIX_V1 + "/adopt/{kind}", calls.adopt, methods=["POST"]),
            Route(PREFIX_V1 + "/volumes", calls.volume, methods=["POST"]),
            Route(PREFIX_V1 + "/volumes/{volume_id}/{op}", calls.on_volume, methods=["POST"]),
        ],
        exception_handlers=JSON_ERRORS,
    )


class _Calls:
    def __init__(self, app: ASGIApp, draining: Callable[[], bool]) -> None:
        self.app = app
        self.draining = draining

    async def create(self, request: Request) -> Response:
        call = await _parsed(request, CreateSandbox)
        if self.draining():
            return _answer(_DRAINING)
        headers = []
        if call.idempotency_key is not None:
            headers.append((IDEMPOTENCY_HEADER.lower().encode(), call.idempotency_key.encode()))
        return await self._run(request, "POST", CREATE_ROUTES[call.api], call.body, headers)

    async def sandbox(self, request: Request) -> Response:
        op = _enum(SandboxOp, request.path_params["op"], "op")
        call = await _parsed(request, SandboxCall)
        method, path = SANDBOX_ROUTES[op]
        path = path.format(id=request.path_params["sandbox_id"])
        return await self._run(request, method, path, call.body)

    async def template(self, request: Request) -> Response:
        op = _enum(TemplateOp, request.path_params["op"], "op")
        call = await _parsed(request, TemplateCall)
        method, path = TEMPLATE_ROUTES[op]
        path = path.format(id=request.path_params["template_id"])
        return await self._run(request, method, path, call.body, query=call.query)

    async def request_build(self, request: Request) -> Response:
        call = await _parsed(request, RequestBuild)
        return await self._run(request, "POST", BUILDS_ROUTE, call.body)

    async def build(self, request: Request) -> Response:
        op = _enum(BuildOp, request.path_params["op"], "op")
        call = await _parsed(request, BuildCall)
        method, path = BUILD_ROUTES[op]
        params = request.path_params
        path = path.format(id=params["template_id"], build=params["build_id"])
        return await self._run(request, method, path, call.body, query=call.query)

    async def files(self, request: Request) -> Response:
        await _parsed(request, FilesCall)
        params = request.path_params
        path = FILES_ROUTE.format(id=params["template_id"], hash=params["hash"])
        return await self._run(request, "GET", path, "")

    async def tags(self, request: Request) -> Response:
        op = _enum(TagOp, request.path_params["op"], "op")
        call = await _parsed(request, TagCall)
        method, path = TAG_ROUTES[op]
        return await self._run(request, method, path, call.body)

    async def lists(self, request: Request) -> Response:
        op = _enum(ListOp, request.path_params["op"], "op")
        call = await _parsed(request, ListCall)
        method, path = LIST_ROUTES[op]
        return await self._run(request, method, path, "", query=call.query)

    async def metrics(self, request: Request) -> Response:
        call = await _parsed(request, Metrics)
        query = urlencode({"sandbox_ids": ",".join(call.sandbox_ids)})
        return await self._run(request, "GET", METRICS_ROUTE, "", query=query)

    async def adopt(self, request: Request) -> Response:
        kind = _enum(AdoptKind, request.path_params["kind"], "kind")
        call = await _parsed(request, Adopt)
        return await self._run(request, "POST", ADOPT_ROUTES[kind], call.record)

    async def volume(self, request: Request) -> Response:
        call = await _parsed(request, CreateVolume)
        return await self._run(request, "POST", VOLUMES_ROUTE, call.body)

    async def on_volume(self, request: Request) -> Response:
        op = _enum(VolumeOp, request.path_params["op"], "op")
        await _parsed(request, VolumeCall)
        method, path = VOLUME_ROUTES[op]
        path = path.format(id=request.path_params["volume_id"])
        return await self._run(request, method, path, "")

    async def _run(
        self,
        request: Request,
        method: str,
        path: str,
        body: str,
        headers: list[tuple[bytes, bytes]] | None = None,
        query: str = "",
    ) -> Response:
        outer = request.scope
        inner = _run_inner(self.app, outer, method, path, query, body, headers or [])
        return _answer(await inner)


def _answer(answer: NodeAnswer) -> Response:
    return Response(answer.model_dump_json(), media_type="application/json")


_DRAINING = NodeAnswer(
    refusal=Refusal.DRAINING,
    status=503,
    headers=[("content-type", "application/json")],
    body=json.dumps({"code": 503, "message": "this node is draining: it takes no new sandboxes"}),
)


async def _run_inner(
    app: ASGIApp,
    outer: Scope,
    method: str,
    path: str,
    query: str,
    body: str,
    headers: list[tuple[bytes, bytes]],
) -> NodeAnswer:
    """`method path?query` with `body` on the node's app, in this process, for the caller the
    outer request names; the E2B answer with the refusal its route recorded."""
    raw = body.encode()
    state: dict[str, Any] = {CALLER_STATE: outer.get("state", {}).get(CALLER_STATE)}
    scope: Scope = {
        **outer,
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(raw)).encode()),
            *headers,
        ],
        "state": state,
    }
    for key in ("route", "endpoint", "path_params", "router", "app"):
        scope.pop(key, None)
    start: dict[str, Any] = {}
    chunks: list[bytes] = []
    answered = asyncio.Event()
    pending = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive() -> Message:
        if pending:
            return pending.pop()
        await answered.wait()  # a route listening for the client's disconnect hears it now
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            start.update(message)
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                answered.set()

    try:
        await app(scope, receive, send)
    finally:
        answered.set()
    status = int(start.get("status", 500))
    refusal: Refusal | None = state.get(REFUSAL_STATE)
    if refusal is None and status >= 400:
        # Refused before any route ran (the node's own gates): the answer is the client's.
        refusal = Refusal.REJECTED
    return NodeAnswer(
        refusal=refusal,
        status=status,
        headers=[
            (n.decode("latin-1"), v.decode("latin-1"))
            for n, v in start.get("headers", [])
            if n.decode("latin-1").lower() not in _SET_AGAIN
        ],
        body=b"".join(chunks).decode(),
    )


async def _parsed(request: Request, model: type[M]) -> M:
    check_query(request)
    return await parse_body(request, model)


def _enum(kind: type[E], value: str, field: str) -> E:
    try:
        return kind(value)
    except ValueError as e:
        known = ", ".join(k.value for k in kind)
        raise APIError(400, f"{field}: '{value}' is not one of {known}") from e
