"""The envd ASGI application: Connect RPC services and plain HTTP routes behind one
access-token gate, on one port."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from functools import partial

from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from aenv.envd.auth import TOKEN_HEADER, UNAUTHORIZED_MESSAGE, route_needs_token, tokens_equal
from aenv.envd.filesystem.service import FilesystemService
from aenv.envd.http import files, system
from aenv.envd.process.service import ProcessService
from aenv.envd.process.table import ProcessTable
from aenv.envd.proto.filesystem.filesystem_connect import FilesystemASGIApplication
from aenv.envd.proto.process.process_connect import ProcessASGIApplication
from aenv.envd.settings import Settings


async def _unauthorized(send: Send) -> None:
    body = json.dumps({"code": 401, "message": UNAUTHORIZED_MESSAGE}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value).decode("latin-1")
    return None


def create_app(settings: Settings) -> ASGIApp:
    table = ProcessTable(settings.process_retention)
    filesystem = FilesystemService(settings)
    rpc_apps: dict[str, ASGIApp] = {
        "/process.Process/": ProcessASGIApplication(ProcessService(settings, table)),
        "/filesystem.Filesystem/": FilesystemASGIApplication(filesystem),
    }
    sampler = system.CPUSampler()

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        await filesystem.close()
        table.kill_all()

    http = Starlette(
        routes=[
            Route("/health", system.health, methods=["GET"]),
            Route("/init", partial(system.init, settings=settings), methods=["POST"]),
            Route("/envs", partial(system.envs, settings=settings), methods=["GET"]),
            Route("/metrics", partial(system.metrics, sampler=sampler), methods=["GET"]),
            Route("/files", partial(files.download, settings=settings), methods=["GET"]),
            Route("/files", partial(files.upload, settings=settings), methods=["POST"]),
        ],
        lifespan=lifespan,
    )
    token_header = TOKEN_HEADER.encode()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await http(scope, receive, send)
            return
        path: str = scope["path"]
        token = settings.access_token
        if (
            token is not None
            and route_needs_token(scope["method"], path)
            and not tokens_equal(token, _header(scope, token_header))
        ):
            await _unauthorized(send)
            return
        for prefix, rpc in rpc_apps.items():
            if path.startswith(prefix):
                await rpc(scope, receive, send)
                return
        await http(scope, receive, send)

    return app
