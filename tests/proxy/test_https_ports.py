"""A sandbox port whose service speaks HTTPS itself (E2B's `httpsPorts`): the proxy reaches it
over TLS without verifying its (self-signed) certificate, for HTTP and WebSockets, while the
client talks to the proxy as usual; the same port without the setting gets plain HTTP, which
the TLS service refuses."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trustme
from websockets.asyncio.client import connect

from tests.proxy.conftest import USER_PORT
from tests.proxy.support import DictResolver, FakeSandbox, Probe, serve, upstream_app
from tests.support.ports import free_port

SANDBOX = "httpssandbox00000001"
PLAIN = "httpssandbox00000002"


@pytest.fixture
def tls_upstream(tmp_path: Path, probe: Probe, resolver: DictResolver) -> Iterator[None]:
    """The upstream test app over TLS, with a certificate no one trusts, as port USER_PORT of
    SANDBOX (an HTTPS port) and of PLAIN (not one)."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    issued = trustme.CA().issue_cert("sandbox.invalid")
    issued.cert_chain_pems[0].write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    port = free_port()
    with serve(upstream_app(probe), port, tls=(cert, key)):
        resolver.sandboxes[SANDBOX] = FakeSandbox(
            {USER_PORT: port}, https_ports=frozenset({USER_PORT})
        )
        resolver.sandboxes[PLAIN] = FakeSandbox({USER_PORT: port})
        yield
        del resolver.sandboxes[SANDBOX], resolver.sandboxes[PLAIN]


def routed(sandbox_id: str) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(USER_PORT)}


@pytest.mark.usefixtures("tls_upstream")
async def test_http_and_websockets_reach_an_https_port(proxy_url: str) -> None:
    async with httpx.AsyncClient() as client:
        for _ in range(3):  # kept-alive TLS connections are reused
            r = await client.post(f"{proxy_url}/x?y=1", headers=routed(SANDBOX), content=b"body")
            assert r.status_code == 200, r.text
            assert (r.json()["raw_path"], r.json()["body"]) == ("/x", "body")
        refused = await client.get(f"{proxy_url}/x", headers=routed(PLAIN))
        assert refused.status_code == 502
    ws_url = proxy_url.replace("http://", "ws://") + "/ws"
    async with connect(ws_url, additional_headers=routed(SANDBOX)) as ws:
        assert json.loads(await ws.recv())["host"] == proxy_url.removeprefix("http://")
        await ws.send("over tls")
        assert await ws.recv() == "over tls"
