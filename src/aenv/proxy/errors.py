"""The answers the proxy gives in the sandbox's place, and how they are sent.

Status codes and messages are infra's (`packages/shared/pkg/proxy/template/*.go`) because the
SDKs key on them (e2b-protocol.md 3.1): a 502 whose message contains "was not found" is
`SandboxNotRunningException` and makes `is_running()` false; "port is not open" is
`SandboxUnreachableException`. Always JSON: infra renders HTML pages for browsers, we do not.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import Scope, Send

TRAFFIC_TOKEN_HEADER = "e2b-traffic-access-token"  # noqa: S105 - a header name


class ProxyError(Exception):
    """An answer for the client instead of the sandbox's: `status` and a JSON `body`."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(body.get("message"))
        self.status = status
        self.body = body


def bad_route(message: str) -> ProxyError:
    return ProxyError(400, {"code": 400, "message": message})


def sandbox_not_found(sandbox_id: str) -> ProxyError:
    return ProxyError(
        502, {"sandboxId": sandbox_id, "message": "The sandbox was not found", "code": 502}
    )


def sandbox_paused(sandbox_id: str) -> ProxyError:
    # Infra answers a paused sandbox it does not resume as not found. We say why, but keep the
    # status and the "was not found" substring: the SDK then raises SandboxNotRunningException
    # and `is_running()` is false, which is right for a paused sandbox.
    message = "The sandbox was not found running: it is paused. Resume it with Sandbox.connect()"
    return ProxyError(502, {"sandboxId": sandbox_id, "message": message, "code": 502})


def sandbox_unavailable(sandbox_id: str, reason: str) -> ProxyError:
    message = f"The sandbox could not be started to take this request: {reason}"
    return ProxyError(503, {"sandboxId": sandbox_id, "message": message, "code": 503})


def port_closed(sandbox_id: str, port: int) -> ProxyError:
    message = "The sandbox is running but port is not open"
    return ProxyError(502, {"sandboxId": sandbox_id, "message": message, "port": port, "code": 502})


def idle_timeout(sandbox_id: str, port: int, seconds: float) -> ProxyError:
    """Nothing moved between client and sandbox for `seconds` before the sandbox answered."""
    message = f"The sandbox's port did not answer within {seconds:g} s"
    return ProxyError(504, {"sandboxId": sandbox_id, "message": message, "port": port, "code": 504})


def traffic_token_missing(sandbox_id: str) -> ProxyError:
    message = (
        "Sandbox is secured with traffic access token. "
        f"Token header '{TRAFFIC_TOKEN_HEADER}' is missing"
    )
    return ProxyError(403, {"sandboxId": sandbox_id, "message": message, "code": 403})


def traffic_token_invalid(sandbox_id: str) -> ProxyError:
    message = (
        "Sandbox is secured with traffic access token. "
        f"Provided token in header '{TRAFFIC_TOKEN_HEADER}' is invalid"
    )
    return ProxyError(403, {"sandboxId": sandbox_id, "message": message, "code": 403})


def internal_route(path: str) -> ProxyError:
    # 404 and no sandbox id, as infra: the route does not exist at this address, and the
    # answer must not depend on whether the sandbox exists.
    message = (
        "This endpoint is reserved for the control plane and is not reachable through the "
        "sandbox URL"
    )
    return ProxyError(404, {"message": message, "path": path, "code": 404})


def _encoded(error: ProxyError) -> tuple[list[tuple[bytes, bytes]], bytes]:
    body = json.dumps(error.body).encode()
    headers = [
        (b"content-type", b"application/json; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
    ]
    return headers, body


async def send_http(error: ProxyError, send: Send) -> None:
    headers, body = _encoded(error)
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def deny_websocket(error: ProxyError, scope: Scope, send: Send) -> None:
    """Refuse a WebSocket handshake with `error` as an HTTP response where the server supports
    the ASGI denial-response extension (uvicorn does), else with a bare close (403)."""
    if "websocket.http.response" in scope.get("extensions", {}):
        headers, body = _encoded(error)
        await send(
            {"type": "websocket.http.response.start", "status": error.status, "headers": headers}
        )
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1008, "reason": error.body["message"]})
