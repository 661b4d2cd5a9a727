"""The data-plane ASGI app: routes each request (`routing`), asks the orchestrator where the
sandbox is (`resolver`), applies the access checks (`access`) and forwards HTTP (`http`) or
WebSocket (`websocket`) traffic; everything that is not data-plane traffic goes to the control
plane app it wraps. `end_run` ends every exchange with a sandbox run whose VM stopped (`runs`).

Mount it as the outermost app of the one-port server:

    app = SandboxProxy(resolver, domain=config.domain, control_plane=api_app)
    uvicorn.run(app, ..., server_header=False)

(`server_header=False` because upstream responses carry their own `Server`.)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aenv.proxy import cuts
from aenv.proxy.access import Tenancy, check_route, check_team, check_traffic_token, request_host
from aenv.proxy.errors import (
    ProxyError,
    bad_route,
    deny_websocket,
    sandbox_not_found,
    sandbox_paused,
    sandbox_unavailable,
    send_http,
)
from aenv.proxy.headers import masked
from aenv.proxy.http import IDLE_TIMEOUT, HttpForwarder
from aenv.proxy.resolver import (
    Resolver,
    SandboxNotFound,
    SandboxPaused,
    SandboxUnavailable,
    Upstream,
)
from aenv.proxy.routing import RoutingError, Target, route
from aenv.proxy.runs import Runs
from aenv.proxy.signed import SignedFile, envd_target, signed_file
from aenv.proxy.websocket import forward_websocket


class SandboxProxy:
    """ASGI app: data-plane traffic to sandboxes, the rest to `control_plane` (a JSON 404 when
    there is none). `domain` turns on host routing for `{port}-{id}.{domain}`. `signer` names
    the sandbox whose envd token signed a `/files` URL that names no sandbox (`proxy.signed`).
    `tenancy` keeps a request carrying another team's API key from the sandbox (`access`).

    It closes its upstream connections on lifespan shutdown; call `aclose()` instead when the
    server runs without lifespan events."""

    def __init__(
        self,
        resolver: Resolver,
        *,
        domain: str | None = None,
        control_plane: ASGIApp | None = None,
        connect_timeout: float = 10.0,
        keepalive_expiry: float = 4.0,
        idle_timeout: float = IDLE_TIMEOUT,
        signer: Callable[[SignedFile], str | None] | None = None,
        tenancy: Tenancy | None = None,
    ) -> None:
        self._resolver = resolver
        self._tenancy = tenancy
        self._domain = domain
        self._signer = signer
        self._control_plane = control_plane
        self._connect_timeout = connect_timeout
        self._runs = Runs()
        cuts.quiet_uvicorn()  # the answers it cuts on purpose are not application errors
        self._http = HttpForwarder(
            connect_timeout=connect_timeout,
            keepalive_expiry=keepalive_expiry,
            idle_timeout=idle_timeout,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        try:
            target = route(scope, self._domain)
        except RoutingError as exc:
            await _answer(bad_route(exc.message), scope, send)
            return
        if target is None and self._signer is not None:
            signed = signed_file(scope)
            sandbox_id = self._signer(signed) if signed is not None else None
            if sandbox_id is not None:
                target = envd_target(sandbox_id, scope)
        if target is not None:
            await self.serve(target, scope, receive, send)
        elif self._control_plane is not None:
            await self._control_plane(scope, receive, send)
        else:
            await _answer(ProxyError(404, {"code": 404, "message": "Not found"}), scope, send)

    async def serve(self, target: Target, scope: Scope, receive: Receive, send: Send) -> None:
        """Forward a request already routed to `target` (for servers that route themselves)."""
        try:
            check_route(target)
            if self._tenancy is not None:
                scope = await check_team(target, scope, self._tenancy)
            try:
                upstream = await self._resolver.resolve(target.sandbox_id, target.port)
            except SandboxNotFound as exc:
                raise sandbox_not_found(exc.sandbox_id) from exc
            except SandboxPaused as exc:
                raise sandbox_paused(exc.sandbox_id) from exc
            except SandboxUnavailable as exc:
                raise sandbox_unavailable(exc.sandbox_id, exc.reason) from exc
            check_traffic_token(target, upstream, scope["headers"])
            host = request_host(target, upstream)
            if host is not None:
                scope = {**scope, "headers": masked(scope["headers"], host)}
            with self._runs.track((target.sandbox_id, upstream.incarnation)) as exchange:
                try:
                    await self._forward(scope, receive, exchange.watch(send), target, upstream)
                except asyncio.CancelledError:
                    if not exchange.ended:
                        raise
                    exchange.task.uncancel()
                    if not exchange.started:
                        raise sandbox_not_found(target.sandbox_id) from None
                    if scope["type"] == "websocket":
                        with contextlib.suppress(OSError, RuntimeError):
                            await send({"type": "websocket.close", "code": 1011})
                    else:
                        # An HTTP answer under way ends incomplete: uvicorn drops the connection.
                        cuts.cut()
        except ProxyError as exc:
            await _answer(exc, scope, send)

    def quiet_since(self, sandbox_id: str) -> float | None:
        """See `Runs.quiet_since` (idle hibernation asks)."""
        return self._runs.quiet_since(sandbox_id)

    def end_run(self, sandbox_id: str, incarnation: str) -> None:
        """A sandbox's VM stopped: end every exchange with that run of it now."""
        self._runs.end((sandbox_id, incarnation))

    async def _forward(
        self, scope: Scope, receive: Receive, send: Send, target: Target, upstream: Upstream
    ) -> None:
        if scope["type"] == "http":
            await self._http.forward(scope, receive, send, target, upstream)
        else:
            await forward_websocket(
                scope, receive, send, target, upstream, connect_timeout=self._connect_timeout
            )

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._control_plane is None:
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await self.aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return

        async def send_closing(message: Message) -> None:
            # The control plane's shutdown is done: ours comes before reporting it.
            if message["type"] == "lifespan.shutdown.complete":
                await self.aclose()
            await send(message)

        await self._control_plane(scope, receive, send_closing)


async def _answer(error: ProxyError, scope: Scope, send: Send) -> None:
    if scope["type"] == "websocket":
        await deny_websocket(error, scope, send)
    else:
        await send_http(error, send)
