"""Test support for the proxy: a real resolver backed by a dict, uvicorn servers in threads, and
an upstream app with the behaviours the tests observe from the sandbox's side."""

from __future__ import annotations

import asyncio
import json
import socketserver
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from aenv.proxy import SandboxNotFound, SandboxPaused, SandboxUnavailable, Upstream
from tests.support.ports import free_port
from tests.support.wait import eventually_sync

# Long enough for a loaded machine; it only keeps a broken proxy from hanging the suite.
WAIT = 20.0


@dataclass
class FakeSandbox:
    """A "sandbox" on loopback: guest port -> local port (others are closed ports)."""

    ports: dict[int, int]
    traffic_access_token: str | None = None
    paused: bool = False
    # Set: the resolver cannot wake it (`SandboxUnavailable` with this reason).
    unavailable: str | None = None
    incarnation: str = ""
    mask_request_host: str | None = None
    https_ports: frozenset[int] = frozenset()


@dataclass
class DictResolver:
    """The `Resolver` protocol over a dict, as the orchestrator's will be over its catalog."""

    sandboxes: dict[str, FakeSandbox] = field(default_factory=dict)
    closed_port: int = field(default_factory=free_port)

    async def resolve(self, sandbox_id: str, port: int) -> Upstream:
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None:
            raise SandboxNotFound(sandbox_id)
        if sandbox.paused:
            raise SandboxPaused(sandbox_id)
        if sandbox.unavailable is not None:
            raise SandboxUnavailable(sandbox_id, sandbox.unavailable)
        local = sandbox.ports.get(port, self.closed_port)
        return Upstream(
            "127.0.0.1",
            local,
            sandbox.traffic_access_token,
            sandbox.incarnation,
            sandbox.mask_request_host,
            port in sandbox.https_ports,
        )


def loopback_server(
    app: object, port: int, tls: tuple[str | Path, str | Path] | None = None
) -> uvicorn.Server:
    """uvicorn as in production (uvloop, httptools) for the ASGI `app` on 127.0.0.1:`port`,
    over TLS with `tls` (certificate and key files)."""
    config = uvicorn.Config(
        app,  # type: ignore[arg-type]
        host="127.0.0.1",
        port=port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        server_header=False,
        ssl_certfile=tls[0] if tls else None,
        ssl_keyfile=tls[1] if tls else None,
    )
    return uvicorn.Server(config)


@contextmanager
def serve(app: object, port: int, tls: tuple[Path, Path] | None = None) -> Iterator[str]:
    """Serve `app` (`loopback_server`) in a thread of its own; yields the base URL, stops the
    server after."""
    server = loopback_server(app, port, tls)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()

    def started() -> bool:
        if not thread.is_alive():
            raise RuntimeError(f"server on port {port} did not start")
        return server.started

    try:
        eventually_sync(started, f"the server on port {port} started", interval=0.01)
        yield f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(WAIT)


@dataclass
class Probe:
    """What the upstream app saw, readable from the test's thread."""

    sse_release: threading.Event = field(default_factory=threading.Event)
    sse_finished: threading.Event = field(default_factory=threading.Event)
    chunks: list[bytes] = field(default_factory=list)
    chunk_arrived: threading.Condition = field(default_factory=threading.Condition)
    endless_started: threading.Event = field(default_factory=threading.Event)
    endless_disconnected: threading.Event = field(default_factory=threading.Event)
    upload_disconnected: threading.Event = field(default_factory=threading.Event)
    silent_started: threading.Event = field(default_factory=threading.Event)
    silent_disconnected: threading.Event = field(default_factory=threading.Event)

    def wait_chunks(self, count: int) -> None:
        with self.chunk_arrived:
            if not self.chunk_arrived.wait_for(lambda: len(self.chunks) >= count, WAIT):
                raise AssertionError(f"upstream got {len(self.chunks)} chunks, not {count}")


class _Raw:
    """A raw ASGI app as a route endpoint (Starlette wraps plain functions as request handlers)."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._app(scope, receive, send)


def upstream_app(probe: Probe) -> Starlette:
    async def echo(request: Request) -> Response:
        body = await request.body()
        return JSONResponse(
            {
                "method": request.method,
                "path": request.url.path,
                "raw_path": request.scope["raw_path"].decode(),
                "query": request.url.query,
                "headers": [[k, v] for k, v in request.headers.items()],
                "body": body.decode(errors="replace"),
                "peer": request.client.port if request.client else None,
            },
            headers={"x-upstream": "yes"},
        )

    async def sse(request: Request) -> StreamingResponse:
        async def events() -> object:
            yield b"data: first\n\n"
            # The second event waits for the test to have seen the first one through the
            # proxy: a buffering proxy would hold the first back and the test would time out.
            await asyncio.to_thread(probe.sse_release.wait, WAIT)
            yield b"data: second\n\n"
            probe.sse_finished.set()

        return StreamingResponse(events(), media_type="text/event-stream")  # type: ignore[arg-type]

    async def upload(request: Request) -> Response:
        try:
            async for chunk in request.stream():
                if chunk:
                    with probe.chunk_arrived:
                        probe.chunks.append(chunk)
                        probe.chunk_arrived.notify_all()
        except ClientDisconnect:
            probe.upload_disconnected.set()
            raise
        return JSONResponse({"chunks": len(probe.chunks)})

    async def endless(scope: Scope, receive: Receive, send: Send) -> None:
        # Raw ASGI, so the disconnect it records is exactly what uvicorn reports. 1 KiB every
        # 10 ms, or `?flood` 64 KiB as fast as the client takes them.
        await send({"type": "http.response.start", "status": 200, "headers": []})
        flood = scope["query_string"] == b"flood"
        chunk, pause = (b"x" * 65536, 0.0) if flood else (b"x" * 1024, 0.01)

        async def pump() -> None:
            while True:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                probe.endless_started.set()
                await asyncio.sleep(pause)

        task = asyncio.create_task(pump())
        while (await receive())["type"] != "http.disconnect":
            pass
        task.cancel()
        probe.endless_disconnected.set()

    async def silent(scope: Scope, receive: Receive, send: Send) -> None:
        # Never answers; records when its client (the proxy) goes away.
        probe.silent_started.set()
        while (await receive())["type"] != "http.disconnect":
            pass
        probe.silent_disconnected.set()

    async def no_content(request: Request) -> Response:
        return Response(status_code=204)

    async def ws_echo(websocket: WebSocket) -> None:
        subprotocols = websocket.scope.get("subprotocols") or []
        await websocket.accept(subprotocol=subprotocols[0] if subprotocols else None)
        await websocket.send_text(json.dumps({"host": websocket.headers.get("host")}))
        try:
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    return
                if message.get("text") == "close-please":
                    await websocket.close(4001, "asked to")
                    return
                if message.get("bytes") is not None:
                    await websocket.send_bytes(message["bytes"])
                else:
                    await websocket.send_text(message["text"])
        except WebSocketDisconnect:
            return

    async def ws_refuse(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        body = b'{"refused": true}'
        await send(
            {
                "type": "websocket.http.response.start",
                "status": 418,
                "headers": [(b"content-type", b"application/json"), (b"x-why", b"teapot")],
            }
        )
        await send({"type": "websocket.http.response.body", "body": body})

    return Starlette(
        routes=[
            Route("/sse", sse),
            Route("/upload", upload, methods=["POST"]),
            Route("/no-content", no_content),
            Route("/silent", _Raw(silent)),
            Route("/endless", _Raw(endless)),
            WebSocketRoute("/ws", ws_echo),
            WebSocketRoute("/ws-refuse", _Raw(ws_refuse)),
            Route("/{rest:path}", echo, methods=["GET", "POST", "PUT", "DELETE", "HEAD"]),
        ]
    )


# Answers uvicorn would never give, written byte for byte, by request path.
RAW_ANSWERS = {
    b"/until-close": b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nbody until close",
    b"/truncated": b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort",
    b"/garbage": b"NOT HTTP AT ALL\r\n\r\n",
    b"/early-hints": (
        b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
    ),
}
# An empty answer, then, on a connection kept open, a planted second answer: in the same write,
# or a moment later when the connection would be idle in a pool. A proxy that reused such a
# connection would hand the planted answer to the next request.
_PLANTED = b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\nplanted"
OVERRUN_ANSWERS = {
    b"/overrun-at-once": (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n" + _PLANTED, b""),
    b"/overrun-later": (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", _PLANTED),
}
OVERRUN_PAUSE = 0.2
# Set once a planted answer is written (so it is in the proxy's socket buffer): a test waits for
# it rather than for a time after which it should have come.
PLANTED = threading.Event()


class _RawHandler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        request_line = self.rfile.readline()
        while self.rfile.readline() not in (b"\r\n", b""):
            pass
        path = request_line.split(b" ")[1] if b" " in request_line else b""
        if path in OVERRUN_ANSWERS:
            first, later = OVERRUN_ANSWERS[path]
            self.wfile.write(first)
            time.sleep(OVERRUN_PAUSE)
            self.wfile.write(later)
            PLANTED.set()
            # Held open: a reused connection gets no other answer than the planted one.
            self.rfile.read(1)
            return
        self.wfile.write(RAW_ANSWERS.get(path, b"HTTP/1.1 404 Not Found\r\n\r\n"))


@contextmanager
def raw_server() -> Iterator[int]:
    """A TCP server answering each connection's first request from RAW_ANSWERS, then closing."""
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _RawHandler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(WAIT)
