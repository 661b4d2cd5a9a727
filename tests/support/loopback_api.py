"""A node's API app served on a loopback port inside the test's own event loop, for clients
that need a real socket (the SDKs, schemathesis, another thread)."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from starlette.types import ASGIApp


@asynccontextmanager
async def served(app: ASGIApp) -> AsyncIterator[str]:
    """Yields the base URL (`http://127.0.0.1:<port>`); the server stops after."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, lifespan="off", log_level="error")
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    await server.startup(sockets=[sock])
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await server.shutdown()
        sock.close()
