"""The proxy's HTTP/1.1 client to sandboxes: keep-alive connections on asyncio protocols, responses
parsed by httptools (llhttp, the C parser uvicorn serves with).

Why not httpx/httpcore: measured in bench/proxy.py on the dev machine, a 256 MiB `files.read`
through the proxy ran at 0.33 of direct with httpcore (64 KiB reads, each through h11's pure-Python
event machinery and anyio) and `commands.run("true")` paid ~1 ms; this client hands the server
whole socket reads (up to 256 KiB under uvloop) and its per-request work is a few callbacks. It
does only what a reverse proxy needs: forward already-validated header bytes, frame the body
(Content-Length or chunked), stream the response with backpressure, and keep connections alive.

Backpressure: a response buffers at most `_HIGH_WATER` bytes before the socket stops being read;
request body writes wait while the transport's write buffer is full.

A port whose service speaks HTTPS (E2B's `httpsPorts`) is reached over TLS (`BACKEND_TLS`):
encrypted, not authenticated, since a sandbox's certificate is its own (often self-signed) and
the hop is the node's own link to the slot.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator
from typing import cast

import httptools

_HIGH_WATER = 1 << 20


def _backend_tls() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


BACKEND_TLS = _backend_tls()
# Requests that may be sent again on a fresh connection when a pooled one turns out to have been
# closed by the server before it answered (RFC 9110 9.2.2); only without a body, so nothing of
# the client's is consumed twice.
_RETRYABLE = frozenset({b"GET", b"HEAD", b"OPTIONS"})


class UpstreamError(Exception):
    """The sandbox's port refused the connection, or closed or garbled it before answering in
    full. `answered` says whether response headers had arrived."""

    def __init__(self, message: str, *, answered: bool = False) -> None:
        super().__init__(message)
        self.answered = answered


# (host, port, owner): where to connect, and whose connections these are. The owner keeps one
# sandbox run's pooled connections from serving another that now has the same address.
Origin = tuple[str, int, str]


class _Overrun(Exception):
    """The upstream sent bytes after its response was complete."""


class _Connection(asyncio.Protocol):
    """One upstream connection, one request at a time. Bytes from the upstream after its
    response was complete (more than its Content-Length, or anything while the connection waits
    in the pool) close the connection: they would be taken for the next request's answer."""

    def __init__(self, origin: Origin) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.in_use = True
        self.idle_since = 0.0
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._parser = httptools.HttpResponseParser(self)
        self._head_only = False
        self._informational = False
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._until_close = True
        self._headers_done = False
        self._keep_alive = False
        self.complete = False
        self._body: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.complete or not self.in_use:
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if not isinstance(exc.__context__, _Overrun):
                self._fail(f"bad response from upstream: {exc}")
            self.close()
        except httptools.HttpParserError as exc:
            self._fail(f"bad response from upstream: {exc}")
            self.close()

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._can_write.set()
        # A body without Content-Length or chunking runs until the connection closes.
        if self._headers_done and self._until_close and not self.complete:
            self.complete = True
            self._wake()
        elif not self.complete:
            self._fail(f"upstream closed the connection: {exc or 'EOF'}")

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        if self.complete:
            raise _Overrun  # a second message in the same read

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name in (b"content-length", b"transfer-encoding"):
            self._until_close = False
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            # 1xx interim answers (103 Early Hints...) are dropped: ASGI cannot send them.
            self._informational = True
            self.headers = []
            self._until_close = True
            return
        self.status = status
        self._headers_done = True
        # Asked now: llhttp resets what it knows once the message is complete.
        self._keep_alive = self._parser.should_keep_alive()
        if self._head_only or status in (204, 304):
            self._until_close = False
            # llhttp cannot be told a HEAD response has no body; it is complete now.
            self.complete = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        self.complete = True
        self._wake()

    # -- used by the pool and the response

    def start(self, method: bytes) -> None:
        """Prepare for a new request (fresh parser state)."""
        self._parser = httptools.HttpResponseParser(self)
        self.in_use = True
        self._head_only = method == b"HEAD"
        self._informational = False
        self.status = 0
        self.headers = []
        self._until_close = True
        self._headers_done = False
        self._keep_alive = False
        self.complete = False
        self._body.clear()
        self._buffered = 0
        self._error = None

    def write(self, data: bytes | list[bytes]) -> None:
        assert self.transport is not None
        if self.closed:
            return
        if isinstance(data, list):
            self.transport.writelines(data)
        else:
            self.transport.write(data)

    async def drain(self) -> None:
        if not self._can_write.is_set():
            await self._can_write.wait()

    async def headers_received(self) -> None:
        while not self._headers_done:
            if self._error is not None:
                raise self._error
            await self._wait()

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            if self._body:
                data = self._body[0] if len(self._body) == 1 else b"".join(self._body)
                self._body.clear()
                self._buffered = 0
                if self._paused and self.transport is not None:
                    self._paused = False
                    self.transport.resume_reading()
                yield data
            elif self.complete:
                return
            elif self._error is not None:
                raise self._error
            else:
                await self._wait()

    @property
    def has_buffered_body(self) -> bool:
        return bool(self._body)

    @property
    def reusable(self) -> bool:
        return self.complete and not self.closed and not self._body and self._keep_alive

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _wait(self) -> asyncio.Future[None]:
        self._waiter = asyncio.get_running_loop().create_future()
        return self._waiter

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, message: str) -> None:
        if self._error is None:
            self._error = UpstreamError(message, answered=self._headers_done)
        self._wake()


class Response:
    """An upstream response whose headers have arrived; `stream()` yields its body as it comes.
    `release()` must be called once done with it: it returns the connection to the pool when the
    body was read to its end, and closes it otherwise (which is how a cancelled request reaches
    the sandbox)."""

    __slots__ = ("_conn", "_pool", "_released", "headers", "status")

    def __init__(self, pool: Pool, conn: _Connection) -> None:
        self._pool = pool
        self._conn = conn
        self._released = False
        self.status = conn.status
        self.headers = conn.headers

    def stream(self) -> AsyncIterator[bytes]:
        return self._conn.chunks()

    @property
    def complete(self) -> bool:
        """Whether the chunk last yielded by `stream()` was the body's last."""
        return self._conn.complete and not self._conn.has_buffered_body

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self._conn.reusable:
            self._pool.keep(self._conn)
        else:
            self._conn.close()


class Pool:
    """Keep-alive connections to upstreams, by `Origin`, reused most-recent first.

    An idle connection is reused for at most `keepalive_expiry` seconds; past that it is closed
    (checked on use, and for all upstreams every `keepalive_expiry` seconds)."""

    def __init__(
        self, *, connect_timeout: float, keepalive_expiry: float, max_idle_per_upstream: int = 64
    ) -> None:
        self._connect_timeout = connect_timeout
        self._expiry = keepalive_expiry
        self._max_idle = max_idle_per_upstream
        self._idle: dict[Origin, list[_Connection]] = {}
        self._next_sweep = 0.0

    async def request(
        self,
        method: bytes,
        origin: Origin,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: AsyncIterable[bytes] | None,
        *,
        chunked: bool,
        tls: bool = False,
    ) -> Response:
        """Send a request (headers already end-to-end, with their framing header) and wait for
        the response headers, over TLS with `tls` (the same for every request to one `origin`).
        Raises `UpstreamError` when the upstream does not answer."""
        head = b"".join(
            [method, b" ", target, b" HTTP/1.1\r\n"]
            + [b"%s: %s\r\n" % header for header in headers]
            + [b"\r\n"]
        )
        retry = body is None and method in _RETRYABLE
        while True:
            conn, reused = await self._checkout(origin, tls)
            try:
                conn.start(method)
                conn.write(head)
                if body is not None:
                    await _send_body(conn, body, chunked)
                await conn.headers_received()
            except UpstreamError as exc:
                conn.close()
                # A pooled connection the server had just closed: try once on a new one.
                if reused and retry and not exc.answered:
                    retry = False
                    continue
                raise
            except BaseException:
                conn.close()
                raise
            return Response(self, conn)

    def keep(self, conn: _Connection) -> None:
        conn.in_use = False
        now = asyncio.get_running_loop().time()
        conn.idle_since = now
        idle = self._idle.setdefault(conn.origin, [])
        if len(idle) < self._max_idle:
            idle.append(conn)
        else:
            conn.close()
        if now >= self._next_sweep:
            self._sweep(now)

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    async def _checkout(self, origin: Origin, tls: bool) -> tuple[_Connection, bool]:
        loop = asyncio.get_running_loop()
        idle = self._idle.get(origin)
        now = loop.time()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self._expiry:
                return conn, True
            conn.close()
        conn = _Connection(origin)
        try:
            async with asyncio.timeout(self._connect_timeout):
                await loop.create_connection(
                    lambda: conn, origin[0], origin[1], ssl=BACKEND_TLS if tls else None
                )
        except (OSError, TimeoutError) as exc:
            raise UpstreamError(f"cannot connect to {origin[0]}:{origin[1]}: {exc!r}") from exc
        return conn, False

    def _sweep(self, now: float) -> None:
        for origin, conns in list(self._idle.items()):
            fresh = [c for c in conns if not c.closed and now - c.idle_since < self._expiry]
            for conn in conns:
                if conn not in fresh:
                    conn.close()
            if fresh:
                self._idle[origin] = fresh
            else:
                del self._idle[origin]
        self._next_sweep = now + self._expiry


async def _send_body(conn: _Connection, body: AsyncIterable[bytes], chunked: bool) -> None:
    async for chunk in body:
        if conn.closed:
            # The upstream is gone (or answered and closed early); the error or the answer
            # is what the client gets, not the rest of its body.
            return
        if not chunk:
            continue  # an empty chunk would end a chunked body
        conn.write([b"%x\r\n" % len(chunk), chunk, b"\r\n"] if chunked else chunk)
        await conn.drain()
    if chunked:
        conn.write(b"0\r\n\r\n")
