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
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import Any, TypeVar
from urllib.parse import urlencode

from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope

from aenv.api.app import JSON_ERRORS
from aenv.api.errors import APIError
from aenv.api.extensions import WAIT_HEADER
from aenv.api.idempotency import HEADER as IDEMPOTENCY_HEADER
from aenv.api.internal import CALLER_STATE, REFUSAL_STATE
from aenv.api.internal_models import (
    ADOPT_ROUTES,
    CREATE_ROUTES,
    FAMILIES,
    METRICS_ROUTE,
    PREFIX_V1,
    SINGLES,
    Adopt,
    AdoptKind,
    CreateSandbox,
    Family,
    Metrics,
    NodeAnswer,
    Refusal,
    Single,
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
            Route(PREFIX_V1 + "/metrics", calls.metrics, methods=["POST"]),
            Route(PREFIX_V1 + "/adopt/{kind}", calls.adopt, methods=["POST"]),
            *(Route(PREFIX_V1 + f.path, calls.family(f), methods=["POST"]) for f in FAMILIES),
            *(Route(PREFIX_V1 + c.path, calls.single(c), methods=["POST"]) for c in SINGLES),
        ],
        exception_handlers=JSON_ERRORS,
    )


Endpoint = Callable[[Request], Awaitable[Response]]


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
        if call.wait is not None:
            headers.append((WAIT_HEADER.lower().encode(), call.wait.encode()))
        return await self._run(request, "POST", CREATE_ROUTES[call.api], call.body, headers)

    async def metrics(self, request: Request) -> Response:
        call = await _parsed(request, Metrics)
        query = urlencode({"sandbox_ids": ",".join(call.sandbox_ids)})
        return await self._run(request, "GET", METRICS_ROUTE, "", query=query)

    async def adopt(self, request: Request) -> Response:
        kind = _enum(AdoptKind, request.path_params["kind"], "kind")
        call = await _parsed(request, Adopt)
        return await self._run(request, "POST", ADOPT_ROUTES[kind], call.record)

    def family(self, family: Family[Any]) -> Endpoint:
        """The endpoint of `family`'s calls: each run through the route its `op` names."""

        async def run(request: Request) -> Response:
            parts = dict(request.path_params)
            op = _enum(family.ops, parts.pop("op"), "op")
            call = await _parsed(request, family.call)
            method, path = family.routes[op]
            query, body = call.e2b()
            return await self._run(request, method, path.format(**parts), body, query=query)

        return run

    def single(self, single: Single) -> Endpoint:
        async def run(request: Request) -> Response:
            call = await _parsed(request, single.call)
            method, path = single.route
            query, body = call.e2b()
            path = path.format(**request.path_params)
            return await self._run(request, method, path, body, query=query)

        return run

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
        inner = _run_inner(
            self.app, outer, request.receive, method, path, query, body, headers or []
        )
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
    outer_receive: Receive,
    method: str,
    path: str,
    query: str,
    body: str,
    headers: list[tuple[bytes, bytes]],
) -> NodeAnswer:
    """`method path?query` with `body` on the node's app, in this process, for the caller the
    outer request names (its body read: `outer_receive` tells only its disconnect); the E2B
    answer with the refusal its route recorded."""
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

    async def outer_gone() -> None:
        while (await outer_receive())["type"] != "http.disconnect":
            pass

    async def receive() -> Message:
        if pending:
            return pending.pop()
        # A route listening for the client's disconnect hears it once answered, or when the
        # gateway goes away first (a create waiting for capacity then leaves the queue).
        waits = [asyncio.ensure_future(answered.wait()), asyncio.ensure_future(outer_gone())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()
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
