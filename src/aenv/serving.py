"""How the node's port is served: uvicorn's settings, and the connection guards uvicorn lacks.

uvicorn times out idle keep-alive connections only after a response, so a client that
connects and sends nothing, or a request head a byte at a time (slowloris), holds a
connection for ever; nor does it cap connections (`limit_concurrency` answers 503 to requests,
but accepts every connection) or the size of a request's head. `GuardedHttpProtocol` adds all
three: a request's head must arrive whole within `header_timeout` seconds of its first byte (or
of the connection, for the first request) and within `max_header_bytes` (else 431), and past
`max_connections` open connections a new one is closed at once.
"""

from __future__ import annotations

import asyncio
import json
import typing
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from aenv.config import Config

# Idle keep-alive connections live this long: past the SDKs' own keep-alive (httpx pools keep
# connections 300 s in e2b), so the server never closes one a client is about to reuse.
KEEP_ALIVE_S = 650


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a head timeout, a head size limit and a connection
    cap (see the module docstring); the limits are class attributes, set by `guarded`."""

    header_timeout: float = 30.0
    max_connections: int = 4096
    max_head_bytes: int = 64 * 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        # Whether the bytes coming in are a request's head, and how many of them came so far.
        self._in_head = True
        self._head_bytes = 0
        self._heads = 0  # heads completed on this connection
        self._refused = False  # a head was refused: nothing more of this connection is served

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # asyncio hands stream protocols a Transport; uvicorn's signature says so.
        if len(self.connections) >= self.max_connections:
            transport.close()
            return
        super().connection_made(typing.cast(asyncio.Transport, transport))
        self._await_head()

    def data_received(self, data: bytes) -> None:
        in_head, heads = self._in_head, self._heads
        super().data_received(data)
        # A read that was head from its start to its end (no head completed in it) is what the
        # parser holds of it: a long header is buffered whole before it is handed over, so it
        # is counted here, read by read. A read that ends a request and starts the next head
        # is not, so a head can take one read more than the limit.
        whole_head = in_head and self._in_head and self._heads == heads
        if whole_head and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes:
                self._refuse_head()

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
        self._in_head = False
        self._head_bytes = 0
        self._heads += 1
        # Reads are counted only while they hold nothing but head, so a head that arrived
        # with its end in a read (a whole head in one, up to a read's size) is measured here,
        # as parsed: its request line and header lines (trailing blanks of values aside).
        if self._refused or self._parsed_head_bytes() > self.max_head_bytes:
            self._refuse_head()
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_head = True  # what follows is the next request
        if not self._refused:
            super().on_message_complete()

    def _should_upgrade(self) -> bool:
        # A refused head's upgrade is not taken either (uvicorn asks after the parser stops).
        return not self._refused and super()._should_upgrade()

    def _unsupported_upgrade_warning(self) -> None:
        if not self._refused:
            super()._unsupported_upgrade_warning()

    def _parsed_head_bytes(self) -> int:
        line = len(self.parser.get_method()) + len(self.url) + len(" HTTP/1.1\r\n") + 1
        return line + sum(len(name) + len(value) + 4 for name, value in self.headers) + 2

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request it cannot parse (a malformed header, say), as every
        other error of ours: JSON with a code and a message, not uvicorn's plain text."""
        body = json.dumps({"code": 400, "message": msg}).encode()
        self.transport.write(
            b"HTTP/1.1 400 Bad Request\r\n"
            b"content-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
        )
        self.transport.close()

    def _refuse_head(self) -> None:
        self._head_arrived()
        if self._refused:
            return
        self._refused = True
        message = f"request head larger than {self.max_head_bytes} bytes"
        body = json.dumps({"code": 431, "message": message}).encode()
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
        )
        self.transport.close()

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


def guarded(config: Config) -> type[GuardedHttpProtocol]:
    """A `GuardedHttpProtocol` class with the configured limits (uvicorn takes a class, not an
    instance)."""
    limits = {
        "header_timeout": config.header_timeout,
        "max_connections": config.max_connections,
        "max_head_bytes": config.max_header_bytes,
    }
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,), limits)


def uvicorn_config(app: Any, config: Config) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        loop="uvloop",
        http=guarded(config),
        lifespan="off",
        access_log=False,
        log_level="warning",
        # Proxied responses carry the sandbox's own Server header.
        server_header=False,
        timeout_keep_alive=KEEP_ALIVE_S,
        ssl_certfile=config.tls_cert,
        ssl_keyfile=config.tls_key,
    )
