"""HTTP forwarding: one request from the ASGI server to a sandbox and its response back, streamed
both ways with no buffering.

Streaming and backpressure: each request body message is written upstream (waiting while the
upstream socket is full) before the next is read, and each upstream read is handed to uvicorn's
`send`, which waits while the client's socket is full; the upstream client stops reading past a
small buffer (`client`). A client that goes away ends the upstream request: mid-body by
`receive` returning `http.disconnect`, afterwards (waiting for the answer, or mid-response) by a
watcher task that cancels the forwarding (uvicorn's `send` silently drops data once the client is
gone, so without it an endless stream would be read forever). Ending the upstream request means
closing its connection, which the sandbox's server sees as its client leaving. So does
`IDLE_TIMEOUT` without a byte moving: a sandbox that never answers gets a 504 to its client, a
client that stops reading (or sending) has its connection dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from starlette.types import Receive, Scope, Send

from aenv.proxy import cuts
from aenv.proxy.client import Pool, Response, UpstreamError
from aenv.proxy.errors import idle_timeout, port_closed
from aenv.proxy.headers import request_headers, response_headers
from aenv.proxy.resolver import Upstream
from aenv.proxy.routing import Target

log = logging.getLogger(__name__)


# Seconds an exchange may go without a byte moving either way (a sandbox that does not answer,
# a client that sends or reads nothing) before the proxy ends it.
IDLE_TIMEOUT = 600.0


class _Idle:
    """The idle deadline of one exchange, pushed back when bytes move. Moving a timer costs a
    heap operation, too much for every chunk of a stream: it moves only once a quarter of the
    timeout has passed, so an exchange ends after between 3/4 and all of the timeout idle."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.answered = False  # response headers sent to the client
        self.deadline = asyncio.timeout(seconds)
        self._loop = asyncio.get_running_loop()

    def touch(self) -> None:
        now = self._loop.time()
        when = self.deadline.when()
        if when is None or when - now < self.seconds * 0.75:
            self.deadline.reschedule(now + self.seconds)


class _ClientGone(Exception):
    """The client disconnected while its request body was being forwarded."""


class _DisconnectWatch:
    """Cancels the forwarding task if the client disconnects once its request body is read
    (until then, reading the body notices it)."""

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._receive = receive
        self._watcher: asyncio.Task[None] | None = None
        # From when the response's end is sent: uvicorn answers `http.disconnect` then too.
        self.finished = False
        self.gone = False

    def start(self) -> None:
        self._watcher = asyncio.create_task(self._watch())

    def absorb(self) -> None:
        """Undo the cancellation this watch caused, so the task goes on."""
        self._task.uncancel()

    def stop(self) -> None:
        self.finished = True
        if self._watcher is not None:
            self._watcher.cancel()

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        if not self.finished:
            self.gone = True
            self._task.cancel()


class HttpForwarder:
    """Forwards HTTP requests over a shared keep-alive pool. Pooled connections belong to one
    sandbox run (id and `Upstream.incarnation`): a slot's next occupant, or the same sandbox
    after a resume, never gets its predecessor's. `keepalive_expiry` is how long an idle one is
    kept; below the 5 s idle timeout common in web servers (Node, uvicorn), so that the server
    rarely closes a connection just as it is reused."""

    def __init__(
        self,
        *,
        connect_timeout: float = 10.0,
        keepalive_expiry: float = 4.0,
        max_idle_per_upstream: int = 64,
        idle_timeout: float = IDLE_TIMEOUT,
    ) -> None:
        # No limit on open connections: long streams (commands, watches) hold theirs for hours,
        # and a cap would queue every other request behind them. No per-read timeout either:
        # an exchange ends only when nothing moved either way for `idle_timeout` (envd pings
        # its streams every 90 s or as the client asks, so only a dead one goes that long).
        self._idle_timeout = idle_timeout
        self._pool = Pool(
            connect_timeout=connect_timeout,
            keepalive_expiry=keepalive_expiry,
            max_idle_per_upstream=max_idle_per_upstream,
        )

    async def aclose(self) -> None:
        await self._pool.aclose()

    async def forward(
        self, scope: Scope, receive: Receive, send: Send, target: Target, upstream: Upstream
    ) -> None:
        """Forward the request in `scope` to `upstream` and stream its response to `send`.
        Raises the 502 `ProxyError` when the sandbox's port does not answer."""
        headers, has_body, chunked = request_headers(scope["headers"])
        if not any(name == b"host" for name, _ in headers):
            headers.append((b"host", f"{upstream.host}:{upstream.port}".encode()))
        path = target.raw_path
        if scope.get("query_string"):
            path += b"?" + scope["query_string"]
        watch = _DisconnectWatch(receive)
        if not has_body:
            watch.start()
        idle = _Idle(self._idle_timeout)
        try:
            async with idle.deadline:
                response = await self._pool.request(
                    scope["method"].encode(),
                    (upstream.host, upstream.port, f"{target.sandbox_id}/{upstream.incarnation}"),
                    path,
                    headers,
                    _body(receive, watch, idle) if has_body else None,
                    chunked=chunked,
                    tls=upstream.tls,
                )
                try:
                    await _respond(response, send, watch, target, idle)
                finally:
                    response.release()
        except _ClientGone:
            return
        except UpstreamError as exc:
            log.info("sandbox %s port %d: %s", target.sandbox_id, target.port, exc)
            raise port_closed(target.sandbox_id, target.port) from exc
        except TimeoutError as exc:
            log.info(
                "sandbox %s port %d: idle for %g s", target.sandbox_id, target.port, idle.seconds
            )
            if not idle.answered:
                raise idle_timeout(target.sandbox_id, target.port, idle.seconds) from exc
            # Headers are out: ending the response incomplete makes uvicorn drop the client.
            cuts.cut()
        except asyncio.CancelledError:
            if not watch.gone:
                raise
            # Our own cancellation: the client left. Absorb it; the upstream connection was
            # closed by `release` on the way out.
            watch.absorb()
        finally:
            watch.stop()


async def _respond(
    response: Response, send: Send, watch: _DisconnectWatch, target: Target, idle: _Idle
) -> None:
    idle.answered = True
    idle.touch()
    await send(
        {
            "type": "http.response.start",
            "status": response.status,
            "headers": response_headers(response.headers),
        }
    )
    try:
        async for chunk in response.stream():
            # Known complete: say so with the last chunk, saving the client a write.
            last = watch.finished = response.complete
            idle.touch()
            await send({"type": "http.response.body", "body": chunk, "more_body": not last})
            idle.touch()  # the client took it: a client that stops reading times out too
            if last:
                return
    except UpstreamError as exc:
        # Headers are out: the only way left to signal the failure is to end the response
        # incomplete, which makes uvicorn drop the client connection.
        log.warning("sandbox %s port %d: response cut: %s", target.sandbox_id, target.port, exc)
        cuts.cut()
        return
    watch.finished = True
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _body(receive: Receive, watch: _DisconnectWatch, idle: _Idle) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        if body := message.get("body", b""):
            idle.touch()
            yield body
            idle.touch()
        if not message.get("more_body", False):
            watch.start()
            return
