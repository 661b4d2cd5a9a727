"""A node's API app served on a loopback port inside the test's own event loop, for clients
that need a real socket (the SDKs, schemathesis, another thread)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from starlette.types import ASGIApp


@asynccontextmanager
async def served(app: ASGIApp) -> AsyncIterator[str]:
    """Yields the base URL (`http://127.0.0.1:<port>`); the server stops after."""
    # Named TCP, not left to the default protocol 0: asyncio sets TCP_NODELAY only on sockets
    # whose protocol says TCP, and without it each answer uvicorn writes in two parts (head,
    # then body) waits for the client's delayed ACK, 40 ms an answer.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, lifespan="off", log_level="error")
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    await server.startup(sockets=[sock])
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await stop(server)
        sock.close()


async def stop(server: uvicorn.Server) -> None:
    """What `server.shutdown()` does for a server without lifespan, less its pauses: it sleeps
    0.1 s before it looks at the connections and 0.1 s at a time while they close, and the
    tests stop a server or a double VM's envd several times each (≈ 40 s of idle in the fast
    suite). A connection that is shut down goes within a loop turn or two, once its answer is
    sent."""
    for listener in server.servers:
        listener.close()
    for connection in list(server.server_state.connections):
        connection.shutdown()
    while server.server_state.connections or server.server_state.tasks:
        await asyncio.sleep(0.001)
    for listener in server.servers:
        await listener.wait_closed()
