"""WebSockets through the proxy, driven by the `websockets` client: echo both ways, subprotocol,
close codes, the sandbox's refusals, and the proxy's own answers as handshake responses."""

from __future__ import annotations

import json

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.proxy.conftest import DOMAIN, USER_PORT
from tests.proxy.support import DictResolver, FakeSandbox


def ws_url(proxy_url: str, path: str) -> str:
    return proxy_url.replace("http://", "ws://") + path


def routed(sandbox_id: str, port: int = USER_PORT) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(port)}


async def test_echo_by_headers_with_subprotocol(proxy_url: str, sandbox_id: str) -> None:
    async with connect(
        ws_url(proxy_url, "/ws?x=1"),
        additional_headers=routed(sandbox_id),
        subprotocols=["chat.v2"],  # type: ignore[list-item]
    ) as ws:
        assert ws.subprotocol == "chat.v2"
        hello = json.loads(await ws.recv())
        # The sandbox sees the Host the client used.
        assert hello["host"] == proxy_url.removeprefix("http://")
        await ws.send("text message")
        assert await ws.recv() == "text message"
        await ws.send(b"\x00\x01binary" * 10000)
        assert await ws.recv() == b"\x00\x01binary" * 10000


async def test_echo_by_host_and_by_path(proxy_url: str, sandbox_id: str) -> None:
    host = f"{USER_PORT}-{sandbox_id}.{DOMAIN}"
    # The URI names the sandbox's host; host/port say where the proxy really is.
    proxy_port = int(proxy_url.rsplit(":", 1)[1])
    async with connect(f"ws://{host}/ws", host="127.0.0.1", port=proxy_port) as ws:
        assert json.loads(await ws.recv())["host"] == host
        await ws.send("by host")
        assert await ws.recv() == "by host"
    async with connect(ws_url(proxy_url, f"/proxy/{sandbox_id}/{USER_PORT}/ws")) as ws:
        await ws.recv()
        await ws.send("by path")
        assert await ws.recv() == "by path"


async def test_sandbox_close_code_reaches_the_client(proxy_url: str, sandbox_id: str) -> None:
    async with connect(ws_url(proxy_url, "/ws"), additional_headers=routed(sandbox_id)) as ws:
        await ws.recv()
        await ws.send("close-please")
        with pytest.raises(ConnectionClosed):
            await ws.recv()
    assert (ws.close_code, ws.close_reason) == (4001, "asked to")


async def test_sandbox_refusal_reaches_the_client(proxy_url: str, sandbox_id: str) -> None:
    with pytest.raises(InvalidStatus) as caught:
        await connect(ws_url(proxy_url, "/ws-refuse"), additional_headers=routed(sandbox_id))
    response = caught.value.response
    assert (response.status_code, response.headers["x-why"], response.body) == (
        418,
        "teapot",
        b'{"refused": true}',
    )


async def test_unknown_sandbox_and_closed_port(proxy_url: str, resolver: DictResolver) -> None:
    with pytest.raises(InvalidStatus) as caught:
        await connect(ws_url(proxy_url, "/ws"), additional_headers=routed("nosuchsandbox0000000"))
    assert caught.value.response.status_code == 502
    assert json.loads(caught.value.response.body) == {
        "sandboxId": "nosuchsandbox0000000",
        "message": "The sandbox was not found",
        "code": 502,
    }
    resolver.sandboxes["closedsandbox0000001"] = FakeSandbox({})
    try:
        with pytest.raises(InvalidStatus) as caught:
            await connect(
                ws_url(proxy_url, "/ws"), additional_headers=routed("closedsandbox0000001")
            )
    finally:
        del resolver.sandboxes["closedsandbox0000001"]
    assert caught.value.response.status_code == 502
    assert b"port is not open" in caught.value.response.body


async def test_traffic_token_on_websockets(
    proxy_url: str, resolver: DictResolver, sandbox_id: str
) -> None:
    resolver.sandboxes[sandbox_id].traffic_access_token = "s3cret"
    with pytest.raises(InvalidStatus) as caught:
        await connect(ws_url(proxy_url, "/ws"), additional_headers=routed(sandbox_id))
    assert caught.value.response.status_code == 403
    headers = {**routed(sandbox_id), "e2b-traffic-access-token": "s3cret"}
    async with connect(ws_url(proxy_url, "/ws"), additional_headers=headers) as ws:
        await ws.recv()
        await ws.send("in")
        assert await ws.recv() == "in"


async def test_many_messages_in_flight(proxy_url: str, sandbox_id: str) -> None:
    # Both directions at once, more messages than any queue holds: nothing lost or reordered.
    async with connect(ws_url(proxy_url, "/ws"), additional_headers=routed(sandbox_id)) as ws:
        await ws.recv()
        for i in range(500):
            await ws.send(f"m{i}")
        assert [await ws.recv() for _ in range(500)] == [f"m{i}" for i in range(500)]


async def test_masked_request_host(
    proxy_url: str, resolver: DictResolver, upstream_port: int
) -> None:
    sandbox_id = "maskedsandbox0000002"
    mask = "masked.test:${PORT}"
    resolver.sandboxes[sandbox_id] = FakeSandbox({USER_PORT: upstream_port}, mask_request_host=mask)
    try:
        async with connect(ws_url(proxy_url, "/ws"), additional_headers=routed(sandbox_id)) as ws:
            assert json.loads(await ws.recv())["host"] == f"masked.test:{USER_PORT}"
    finally:
        del resolver.sandboxes[sandbox_id]
