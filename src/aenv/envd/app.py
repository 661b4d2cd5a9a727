"""The envd ASGI application: Connect RPC services and plain HTTP routes behind one
access-token gate, on one port."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from functools import partial

from connectrpc.errors import ConnectError
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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


# Server-streaming methods: a client may leave while the handler waits for the next event.
_STREAMS = frozenset(
    {"/process.Process/Start", "/process.Process/Connect", "/filesystem.Filesystem/WatchDir"}
)


async def _serve_stream(rpc: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    """Run a streaming RPC and cancel it as soon as its client disconnects.

    connectrpc notices a disconnect only when the handler yields its next message, which for an
    idle watch is up to a keepalive interval later; cancelling at once releases the watch (or
    the process subscription) now. The process itself is never touched by this.
    """
    task = asyncio.current_task()
    assert task is not None
    gone = False

    async def watched_receive() -> Message:
        nonlocal gone
        message = await receive()
        if message["type"] == "http.disconnect" and not gone:
            gone = True
            task.cancel()
        return message

    try:
        await rpc(scope, watched_receive, send)
    except (asyncio.CancelledError, ConnectError):
        if not gone:
            raise
    finally:
        if gone:
            task.uncancel()


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
                if path in _STREAMS:
                    await _serve_stream(rpc, scope, receive, send)
                else:
                    await rpc(scope, receive, send)
                return
        await http(scope, receive, send)

    return app
