"""How the node's port is served: uvicorn's settings, and the connection guards uvicorn lacks.

uvicorn times out idle keep-alive connections only after a response, so a client that
connects and sends nothing, or a request head a byte at a time (slowloris), holds a
connection for ever; nor does it cap connections (`limit_concurrency` answers 503 to requests,
but accepts every connection). `GuardedHttpProtocol` adds both: a request's head must arrive
whole within `header_timeout` seconds of its first byte (or of the connection, for the first
request), and past `max_connections` open connections a new one is closed at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from aenv.config import Config

# Idle keep-alive connections live this long: past the SDKs' own keep-alive (httpx pools keep
# connections 300 s in e2b), so the server never closes one a client is about to reuse.
KEEP_ALIVE_S = 650


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header timeout and a connection cap (see the
    module docstring); the limits come from `header_timeout` and `max_connections` set on the
    class by `guarded`."""

    header_timeout: float = 30.0
    max_connections: int = 4096

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            transport.close()
            return
        super().connection_made(transport)
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_arrived()
        if self.transport is not None:  # None: refused by the cap, never registered
            super().connection_lost(exc)

    def on_message_begin(self) -> None:
        # A kept-alive connection's next request is timed from its first byte; before it,
        # uvicorn's keep-alive timeout applies.
        super().on_message_begin()
        if self._head_timer is None:
            self._await_head()

    def on_headers_complete(self) -> None:
        self._head_arrived()
        super().on_headers_complete()

    def _await_head(self) -> None:
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_too_slow)

    def _head_arrived(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def guarded(header_timeout: float, max_connections: int) -> type[GuardedHttpProtocol]:
    """A `GuardedHttpProtocol` class with these limits (uvicorn takes a class, not an
    instance)."""
    limits = {"header_timeout": header_timeout, "max_connections": max_connections}
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,), limits)


def uvicorn_config(app: Any, config: Config) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        loop="uvloop",
        http=guarded(config.header_timeout, config.max_connections),
        lifespan="off",
        access_log=False,
        log_level="warning",
        # Proxied responses carry the sandbox's own Server header.
        server_header=False,
        timeout_keep_alive=KEEP_ALIVE_S,
    )
