"""SandboxProxy in front of a control plane, as the one-port server mounts it: routing headers
decide, shared paths included, and lifespan events reach the control plane."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from aenv.proxy import SandboxProxy
from tests.proxy.conftest import DOMAIN, USER_PORT
from tests.proxy.support import DictResolver, serve
from tests.support.ports import free_port


def test_control_plane_behind_the_proxy(resolver: DictResolver, sandbox_id: str) -> None:
    lifespan_events: list[str] = []

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        lifespan_events.append("startup")
        yield
        lifespan_events.append("shutdown")

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"plane": "control"})

    control = Starlette(routes=[Route("/health", health)], lifespan=lifespan)
    proxy = SandboxProxy(resolver, domain=DOMAIN, control_plane=control)
    with serve(proxy, free_port()) as url, httpx.Client() as client:
        assert lifespan_events == ["startup"]
        assert client.get(f"{url}/health").json() == {"plane": "control"}
        assert client.get(f"{url}/health", headers={"Host": f"api.{DOMAIN}"}).json() == {
            "plane": "control"
        }
        routed = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(USER_PORT)}
        # The same path with routing headers is the sandbox's.
        assert client.get(f"{url}/health", headers=routed).json()["path"] == "/health"
        by_host = client.get(
            f"{url}/health", headers={"Host": f"{USER_PORT}-{sandbox_id}.{DOMAIN}"}
        )
        assert by_host.json()["path"] == "/health"
    assert lifespan_events == ["startup", "shutdown"]
