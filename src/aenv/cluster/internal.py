"""A node's internal API: what gateways call, under `/internal`, authenticated with the cluster
secret.

Every route of the node (control plane and data plane) is reachable under the prefix, but only
with the cluster's bearer token (`ClusterSecret.bearer`) in `X-Aenv-Cluster-Token`, compared in
constant time; a user's API key opens none of them. A gateway names the API key it checked in
`X-Aenv-Caller`, and its team in `X-Aenv-Caller-Team` (a gateway from before teams sends none:
the default team); the node then acts for that key and team (`aenv.api.internal`), and a call
that names none (an operator's, with the token) acts as `CLUSTER_CALLER`. These headers are
removed before the request goes on, and the prefix is stripped from its path, so the node's own
routing (`aenv.proxy.routing`) sees what it would have seen from a client. Paths outside the
prefix pass through untouched: the node's public API stays as `aenv server` has it.

Under the prefix, `/v1/...` is the typed internal API of version 1 (`aenv.api.internal_v1`);
everything else is version 0, a client's request replayed (`aenv.api.internal_models`):
deprecated for the calls version 1 carries, and served for the previous release's gateways.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from aenv.api.errors import APIError
from aenv.api.internal import CALLER_STATE, OPERATOR_CALLER
from aenv.api.internal_models import PREFIX_V1
from aenv.api.internal_v1 import internal_v1
from aenv.cluster.secret import ClusterSecret
from aenv.proxy.errors import ProxyError, deny_websocket

PREFIX = "/internal"
TOKEN_HEADER = "X-Aenv-Cluster-Token"  # noqa: S105 - a header name
CALLER_HEADER = "X-Aenv-Caller"
TEAM_HEADER = "X-Aenv-Caller-Team"
CLUSTER_CALLER = OPERATOR_CALLER

_TOKEN = TOKEN_HEADER.lower().encode()
_CALLER = CALLER_HEADER.lower().encode()
_TEAM = TEAM_HEADER.lower().encode()


class InternalGate:
    """ASGI middleware in front of a node's app (see the module docstring)."""

    def __init__(
        self, app: ASGIApp, secret: ClusterSecret, draining: Callable[[], bool] = lambda: False
    ) -> None:
        self.app = app
        self.v1 = internal_v1(app, draining)
        self._token = secret.bearer.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if scope["type"] not in ("http", "websocket") or not _under(path, PREFIX):
            await self.app(scope, receive, send)
            return
        given = next((v for n, v in scope["headers"] if n == _TOKEN), b"")
        refusal = _refusal(given, self._token)
        if refusal is not None:
            await _refuse(refusal, scope, receive, send)
            return
        caller = next((v for n, v in scope["headers"] if n == _CALLER), b"").decode("latin-1")
        team = next((v for n, v in scope["headers"] if n == _TEAM), b"").decode("latin-1")
        raw_path: bytes = scope.get("raw_path") or path.encode()
        inner = {
            **scope,
            "path": path[len(PREFIX) :] or "/",
            "raw_path": raw_path[len(PREFIX) :] or b"/",
            "headers": [(n, v) for n, v in scope["headers"] if n not in (_TOKEN, _CALLER, _TEAM)],
            "state": {
                **scope.get("state", {}),
                CALLER_STATE: f"{caller or CLUSTER_CALLER} {team}".strip(),
            },
        }
        await (self.v1 if _under(inner["path"], PREFIX_V1) else self.app)(inner, receive, send)


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


def _refusal(given: bytes, expected: bytes) -> str | None:
    if not given:
        return f"internal routes need the cluster's token in {TOKEN_HEADER}"
    if not hmac.compare_digest(given, expected):
        return "wrong cluster token: the caller's cluster secret differs from this node's"
    return None


async def _refuse(message: str, scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "websocket":
        await receive()  # the handshake's `websocket.connect`, answered with the refusal
        await deny_websocket(ProxyError(401, {"code": 401, "message": message}), scope, send)
        return
    await APIError(401, message).response()(scope, receive, send)
