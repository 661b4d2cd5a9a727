"""A gateway's calls to a node of an earlier build of this release, whose version 1 of the
internal API had fewer calls and fields: a call it has reaches it in version 1, without the
fields the call leaves at their defaults; a call it lacks (no route, an operation or a field it
refuses) did nothing there and is replayed, so the client gets the node's answer either way.
The older node is a double on loopback: its version 1 knows a sandbox's kill only."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from aenv.api.internal_models import INTERNAL_VERSIONS, NodeAnswer
from aenv.cluster.registry import Capacity, NodeReport
from aenv.gateway.nodes import NodeClient
from tests.cluster.shared import SECRET
from tests.proxy.support import serve
from tests.support.ports import free_port


@dataclass
class OlderNode:
    typed: list[tuple[str, bytes]] = field(default_factory=list)  # version 1 calls taken
    replayed: list[str] = field(default_factory=list)  # version 0 requests, with their query

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/internal/v1/sandboxes/{id}/{op}", self.v1_sandbox, methods=["POST"]),
                Route("/internal/v1/{rest:path}", self.v1_unknown, methods=["POST"]),
                Route("/internal/{rest:path}", self.replay, methods=["GET", "POST", "DELETE"]),
            ]
        )

    async def v1_sandbox(self, request: Request) -> Response:
        body = await request.body()
        op, fields = request.path_params["op"], set(json.loads(body))
        if op != "kill":
            return JSONResponse({"code": 400, "message": f"op: '{op}' is not one of kill"}, 400)
        if fields - {"body"}:
            return JSONResponse({"code": 400, "message": f"fields {fields} not supported"}, 400)
        self.typed.append((request.url.path, body))
        return Response(NodeAnswer(status=204).model_dump_json(), media_type="application/json")

    async def v1_unknown(self, request: Request) -> Response:
        return JSONResponse({"code": 404, "message": "not found"}, 404)

    async def replay(self, request: Request) -> Response:
        self.replayed.append(f"{request.method} {request.url.path}?{request.url.query}")
        return JSONResponse({"replayed": True})


@pytest.fixture
def older() -> Iterator[tuple[OlderNode, NodeReport]]:
    node, port = OlderNode(), free_port()
    capacity = Capacity(cpus=2, memory_mb=1024, memory_free_mb=512, running=0, paused=0)
    report = NodeReport("old", f"127.0.0.1:{port}", capacity, internal_versions=INTERNAL_VERSIONS)
    with serve(node.app(), port):
        yield node, report


async def test_calls_an_older_version_1_lacks_are_replayed(
    older: tuple[OlderNode, NodeReport],
) -> None:
    node, report = older
    client = NodeClient(SECRET)
    try:
        killed = await client.call(report, "DELETE", "/sandboxes/sb1", caller="key-1")
        # A new operation, a new field (the query) and a new route: each replayed.
        logs = await client.call(report, "GET", "/sandboxes/sb1/logs?limit=5", caller="key-1")
        info = await client.call(report, "GET", "/sandboxes/sb1?x=1", caller="key-1")
        bulk = "/aenv/bulk/sandboxes/kill?metadata=run%3D1"
        bulked = await client.call(report, "POST", bulk, caller="key-1")
    finally:
        await client.aclose()
    assert (killed.status, killed.refusal) == (204, None)
    assert node.typed == [("/internal/v1/sandboxes/sb1/kill", b"{}")]
    for answer in (logs, info, bulked):
        assert (answer.status, json.loads(answer.body)) == (200, {"replayed": True})
    assert node.replayed == [
        "GET /internal/sandboxes/sb1/logs?limit=5",
        "GET /internal/sandboxes/sb1?x=1",
        "POST /internal/aenv/bulk/sandboxes/kill?metadata=run%3D1",
    ]
