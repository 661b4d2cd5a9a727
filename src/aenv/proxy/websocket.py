"""WebSocket forwarding: the client's ASGI WebSocket joined to a WebSocket opened to the sandbox.

The handshake is redone upstream (with the `websockets` client uvicorn already depends on) before
the client's is accepted, so the client gets the upstream's chosen subprotocol, and an upstream
refusal reaches it as the upstream's own HTTP response. Messages then flow both ways one at a
time: each side's `send` waits while its peer is slow, so neither buffers more than the
library's small queues. Either side closing closes the other with the same code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from starlette.types import Receive, Scope, Send
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from aenv.proxy.client import BACKEND_TLS
from aenv.proxy.errors import port_closed
from aenv.proxy.headers import response_headers, websocket_headers
from aenv.proxy.resolver import Upstream
from aenv.proxy.routing import Target

log = logging.getLogger(__name__)

# Close codes that mark a close without a frame; they must not be sent in one (RFC 6455 7.4.1).
_UNSENDABLE = frozenset({1005, 1006, 1015})


class _NoRedirects(connect):
    """`websockets.connect` follows redirects itself; a proxy must hand them to the client."""

    def process_redirect(self, exc: Exception) -> Exception | str:
        return exc


async def forward_websocket(
    scope: Scope,
    receive: Receive,
    send: Send,
    target: Target,
    upstream: Upstream,
    *,
    connect_timeout: float,
) -> None:
    """Proxy the WebSocket in `scope` to `upstream` until either side closes. Raises the 502
    `ProxyError` (before accepting) when the sandbox's port does not answer."""
    if (await receive())["type"] != "websocket.connect":
        return
    host = next((v.decode("latin-1") for n, v in scope["headers"] if n == b"host"), None)
    path = target.raw_path.decode("latin-1")
    if scope.get("query_string"):
        path += "?" + scope["query_string"].decode("latin-1")
    # The URI carries the client's Host so the sandbox sees it; `host`/`port` say where to dial.
    scheme = "wss" if upstream.tls else "ws"
    uri = f"{scheme}://{host or f'{upstream.host}:{upstream.port}'}{path}"
    try:
        peer = await _NoRedirects(
            uri,
            host=upstream.host,
            port=upstream.port,
            additional_headers=websocket_headers(scope["headers"]),
            subprotocols=scope.get("subprotocols") or None,
            user_agent_header=None,
            proxy=None,
            ssl=BACKEND_TLS if upstream.tls else None,
            # Loopback to the slot: compressing there only costs CPU. The client's side is
            # compressed or not as the client and uvicorn agree.
            compression=None,
            open_timeout=connect_timeout,
            # No pings on the local hop to the slot: no middlebox there to keep awake, and the
            # client's own pings are answered by the ASGI server.
            ping_interval=None,
            max_size=None,
        )
    except InvalidStatus as exc:
        await _refuse(scope, send, exc)
        return
    except (OSError, TimeoutError, InvalidHandshake) as exc:
        log.info("sandbox %s port %d: websocket: %r", target.sandbox_id, target.port, exc)
        raise port_closed(target.sandbox_id, target.port) from exc
    async with peer:
        await send({"type": "websocket.accept", "subprotocol": peer.subprotocol})
        from_peer = asyncio.create_task(_peer_to_client(peer, send))
        try:
            code, reason = await _client_to_peer(receive, peer)
        finally:
            # Stop relaying before closing the peer, so its closing does not send a close to a
            # client that is already gone. Sending to a gone client raises OSError (uvicorn's
            # ClientDisconnected): nothing to do about it.
            from_peer.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await from_peer
        await peer.close(1000 if code in _UNSENDABLE else code, reason)


async def _client_to_peer(receive: Receive, peer: ClientConnection) -> tuple[int, str]:
    """Relay the client's messages until it disconnects; its close code and reason."""
    while True:
        message = await receive()
        if message["type"] == "websocket.disconnect":
            return message.get("code", 1000), message.get("reason") or ""
        data = message.get("bytes")
        # A peer that closed stops taking messages; the relay the other way tells the client.
        with contextlib.suppress(ConnectionClosed):
            await peer.send(data if data is not None else message.get("text") or "")


async def _peer_to_client(peer: ClientConnection, send: Send) -> None:
    """Relay the peer's messages until it closes, then close the client with its code."""
    with contextlib.suppress(ConnectionClosed):
        async for data in peer:
            if isinstance(data, bytes):
                await send({"type": "websocket.send", "bytes": data})
            else:
                await send({"type": "websocket.send", "text": data})
    code = peer.close_code
    await send(
        {
            "type": "websocket.close",
            "code": 1011 if code is None or code in _UNSENDABLE else code,
            "reason": peer.close_reason or "",
        }
    )


async def _refuse(scope: Scope, send: Send, exc: InvalidStatus) -> None:
    """Pass the sandbox's refusal of the handshake on to the client."""
    response = exc.response
    if "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": 1008})
        return
    headers = [(n.encode("latin-1"), v.encode("latin-1")) for n, v in response.headers.raw_items()]
    await send(
        {
            "type": "websocket.http.response.start",
            "status": response.status_code,
            "headers": response_headers(headers),
        }
    )
    await send({"type": "websocket.http.response.body", "body": bytes(response.body)})
