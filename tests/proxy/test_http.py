"""HTTP through the proxy with httpx: the three ways of routing, what the sandbox sees, streaming
both ways, disconnects, and the proxy's own answers."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from aenv.proxy import SandboxProxy
from tests.proxy.conftest import DOMAIN, ENVD, ENVD_SANDBOX, USER_PORT
from tests.proxy.support import (
    PLANTED,
    WAIT,
    DictResolver,
    FakeSandbox,
    Probe,
    raw_server,
    serve,
)
from tests.support.ports import free_port
from tests.support.wait import SAFETY_S


def routed(sandbox_id: str, port: int = USER_PORT) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(port)}


def header_values(echo: dict[str, Any], name: str) -> list[str]:
    return [v for k, v in echo["headers"] if k == name]


async def test_header_routing_forwards_method_path_query_headers_body(
    proxy_url: str, sandbox_id: str
) -> None:
    async with httpx.AsyncClient() as client:
        r = await client.put(
            f"{proxy_url}/health/a%2Fb?x=1&y=%20",
            headers={**routed(sandbox_id), "X-Custom": "v", "Connection": "keep-alive, X-Hop"},
            content=b"payload",
        )
    assert r.status_code == 200
    assert r.headers["x-upstream"] == "yes"
    echo = r.json()
    assert (echo["method"], echo["raw_path"], echo["query"], echo["body"]) == (
        "PUT",
        "/health/a%2Fb",
        "x=1&y=%20",
        "payload",
    )
    assert header_values(echo, "x-custom") == ["v"]
    # The client's Host and the routing headers reach the sandbox; hop-by-hop headers do not.
    assert header_values(echo, "host") == [proxy_url.removeprefix("http://")]
    assert header_values(echo, "e2b-sandbox-id") == [sandbox_id]
    assert header_values(echo, "connection") in ([], ["keep-alive"])
    assert header_values(echo, "x-hop") == []


async def test_host_routing(proxy_url: str, sandbox_id: str) -> None:
    host = f"{USER_PORT}-{sandbox_id}.{DOMAIN}"
    async with httpx.AsyncClient() as client:
        r = await client.get(f"{proxy_url}/some/page?q=1", headers={"Host": host})
        control = await client.get(f"{proxy_url}/some/page", headers={"Host": f"api.{DOMAIN}"})
    assert r.status_code == 200
    assert (r.json()["path"], r.json()["query"]) == ("/some/page", "q=1")
    assert header_values(r.json(), "host") == [host]
    # Not data-plane traffic, and this proxy has no control plane behind it.
    assert (control.status_code, control.json()) == (404, {"code": 404, "message": "Not found"})


async def test_path_routing_strips_the_prefix(proxy_url: str, sandbox_id: str) -> None:
    async with httpx.AsyncClient() as client:
        r = await client.post(
            f"{proxy_url}/proxy/{sandbox_id}/{USER_PORT}/x%20y/z?k=v", content=b"body"
        )
        root = await client.get(f"{proxy_url}/proxy/{sandbox_id}/{USER_PORT}")
    echo = r.json()
    assert (echo["raw_path"], echo["path"], echo["query"], echo["body"]) == (
        "/x%20y/z",
        "/x y/z",
        "k=v",
        "body",
    )
    assert root.json()["path"] == "/"


async def test_head(proxy_url: str, sandbox_id: str) -> None:
    async with httpx.AsyncClient() as client:
        head = await client.head(f"{proxy_url}/x", headers=routed(sandbox_id))
    # The upstream's length of the body it would send, and no body.
    assert head.status_code == 200
    assert int(head.headers["content-length"]) > 0
    assert head.content == b""


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({"E2b-Sandbox-Id": ENVD_SANDBOX}, "Missing header: E2b-Sandbox-Port"),
        ({"E2b-Sandbox-Port": "49983"}, "Missing header: E2b-Sandbox-Id"),
        ({"E2b-Sandbox-Id": ENVD_SANDBOX, "E2b-Sandbox-Port": "x"}, "Invalid sandbox port"),
    ],
)
async def test_bad_routing_is_400(proxy_url: str, headers: dict[str, str], message: str) -> None:
    async with httpx.AsyncClient() as client:
        r = await client.get(f"{proxy_url}/health", headers=headers)
    assert (r.status_code, r.json()) == (400, {"code": 400, "message": message})


async def test_unknown_sandbox_is_the_exact_502(proxy_url: str) -> None:
    async with httpx.AsyncClient() as client:
        r = await client.get(f"{proxy_url}/health", headers=routed("nosuchsandbox0000000", ENVD))
    assert r.status_code == 502
    assert r.headers["content-type"] == "application/json; charset=utf-8"
    assert r.json() == {
        "sandboxId": "nosuchsandbox0000000",
        "message": "The sandbox was not found",
        "code": 502,
    }


async def test_closed_port(proxy_url: str, sandbox_id: str) -> None:
    async with httpx.AsyncClient() as client:
        r = await client.get(f"{proxy_url}/", headers=routed(sandbox_id, 8001))
    assert (r.status_code, r.json()) == (
        502,
        {
            "sandboxId": sandbox_id,
            "message": "The sandbox is running but port is not open",
            "port": 8001,
            "code": 502,
        },
    )


async def test_paused_sandbox(proxy_url: str, resolver: DictResolver) -> None:
    resolver.sandboxes["pausedsandbox0000002"] = FakeSandbox({}, paused=True)
    try:
        async with httpx.AsyncClient() as client:
            r = await client.get(f"{proxy_url}/", headers=routed("pausedsandbox0000002"))
    finally:
        del resolver.sandboxes["pausedsandbox0000002"]
    assert r.status_code == 502
    assert r.json()["sandboxId"] == "pausedsandbox0000002"
    # The substring the SDK maps to SandboxNotRunningException, and the reason.
    assert "was not found" in r.json()["message"]
    assert "paused" in r.json()["message"]


async def test_sandbox_that_cannot_be_woken(proxy_url: str, resolver: DictResolver) -> None:
    """A failed wake (or auto-resume) is a JSON 503 naming the reason, not a traceback."""
    resolver.sandboxes["sleepysandbox0000001"] = FakeSandbox({}, unavailable="restore failed")
    try:
        async with httpx.AsyncClient() as client:
            r = await client.get(f"{proxy_url}/", headers=routed("sleepysandbox0000001"))
    finally:
        del resolver.sandboxes["sleepysandbox0000001"]
    assert r.status_code == 503
    assert r.json()["code"] == 503 and r.json()["sandboxId"] == "sleepysandbox0000001"
    assert "restore failed" in r.json()["message"]


async def test_traffic_access_token(
    proxy_url: str, resolver: DictResolver, sandbox_id: str
) -> None:
    resolver.sandboxes[sandbox_id].traffic_access_token = "s3cret"
    url = f"{proxy_url}/x"
    async with httpx.AsyncClient() as client:
        missing = await client.get(url, headers=routed(sandbox_id))
        wrong = await client.get(
            url, headers={**routed(sandbox_id), "e2b-traffic-access-token": "guess"}
        )
        right = await client.get(
            url, headers={**routed(sandbox_id), "E2B-Traffic-Access-Token": "s3cret"}
        )
    assert (missing.status_code, missing.json()["message"]) == (
        403,
        "Sandbox is secured with traffic access token. "
        "Token header 'e2b-traffic-access-token' is missing",
    )
    assert (wrong.status_code, wrong.json()["message"]) == (
        403,
        "Sandbox is secured with traffic access token. "
        "Provided token in header 'e2b-traffic-access-token' is invalid",
    )
    assert right.status_code == 200


async def test_masked_request_host(
    proxy_url: str, resolver: DictResolver, upstream_port: int
) -> None:
    sandbox_id = "maskedsandbox0000001"
    ports = {USER_PORT: upstream_port, ENVD: upstream_port}
    resolver.sandboxes[sandbox_id] = FakeSandbox(ports, mask_request_host="masked.test:${PORT}")
    try:
        async with httpx.AsyncClient() as client:
            user = await client.get(
                f"{proxy_url}/x", headers={**routed(sandbox_id), "X-Forwarded-Host": "forged"}
            )
            envd = await client.get(f"{proxy_url}/x", headers=routed(sandbox_id, ENVD))
    finally:
        del resolver.sandboxes[sandbox_id]
    client_host = proxy_url.removeprefix("http://")
    assert header_values(user.json(), "host") == [f"masked.test:{USER_PORT}"]
    # The client's own host goes along, as infra's proxy sends it; a client's claim does not.
    assert header_values(user.json(), "x-forwarded-host") == [client_host]
    # envd's port is exempt: it is the SDK's, not the user's service.
    assert header_values(envd.json(), "host") == [client_host]


@pytest.mark.parametrize("path", ["/init", "//init", "/%69nit", "/files/../init", "/init/"])
async def test_envd_control_routes_are_not_reachable(
    proxy_url: str, envd_port: int, path: str
) -> None:
    async with httpx.AsyncClient() as client:
        # Built by hand so httpx does not normalise the path.
        request = client.build_request("POST", f"{proxy_url}/", headers=routed(ENVD_SANDBOX, ENVD))
        request.url = request.url.copy_with(raw_path=path.encode())
        r = await client.send(request)
    assert r.status_code == 404
    assert r.json()["message"].startswith("This endpoint is reserved for the control plane")


async def test_sse_events_arrive_as_sent(proxy_url: str, sandbox_id: str, probe: Probe) -> None:
    async with (
        httpx.AsyncClient(timeout=WAIT) as client,
        client.stream("GET", f"{proxy_url}/sse", headers=routed(sandbox_id)) as r,
    ):
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.aiter_lines()
        assert await anext(lines) == "data: first"
        # The upstream has not finished: it is waiting for us to release it.
        assert not probe.sse_finished.is_set()
        probe.sse_release.set()
        rest = [line async for line in lines if line]
    assert rest == ["data: second"]


async def test_chunked_request_body_is_forwarded_as_it_comes(
    proxy_url: str, sandbox_id: str, probe: Probe
) -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b"a" * 1000
        # Only once the upstream has the first chunk does the second exist: a proxy that
        # collected the whole body first would deadlock here.
        await asyncio.to_thread(probe.wait_chunks, 1)
        yield b"b" * 1000

    async with httpx.AsyncClient(timeout=WAIT) as client:
        r = await client.post(f"{proxy_url}/upload", headers=routed(sandbox_id), content=body())
    assert r.status_code == 200
    assert b"".join(probe.chunks) == b"a" * 1000 + b"b" * 1000


async def test_client_disconnect_cancels_the_upstream_request(
    proxy_url: str, sandbox_id: str, probe: Probe
) -> None:
    async with (
        httpx.AsyncClient(timeout=WAIT) as client,
        client.stream("GET", f"{proxy_url}/endless", headers=routed(sandbox_id)) as r,
    ):
        async for chunk in r.aiter_raw():
            assert chunk
            break
    assert probe.endless_started.is_set()
    assert await asyncio.to_thread(probe.endless_disconnected.wait, WAIT)


async def test_client_disconnect_before_the_answer_cancels_the_upstream_request(
    proxy_url: str, sandbox_id: str, probe: Probe
) -> None:
    async with httpx.AsyncClient(timeout=WAIT) as client:
        get = asyncio.create_task(client.get(f"{proxy_url}/silent", headers=routed(sandbox_id)))
        await asyncio.to_thread(probe.silent_started.wait, WAIT)
        get.cancel()
        with pytest.raises(asyncio.CancelledError):
            await get
    assert await asyncio.to_thread(probe.silent_disconnected.wait, WAIT)


async def test_client_disconnect_mid_body_cancels_the_upstream_request(
    proxy_url: str, sandbox_id: str, probe: Probe
) -> None:
    started = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        yield b"a" * 1000
        started.set()
        await asyncio.sleep(WAIT * 10)
        yield b"never"

    async with httpx.AsyncClient(timeout=WAIT) as client:
        post = asyncio.create_task(
            client.post(f"{proxy_url}/upload", headers=routed(sandbox_id), content=body())
        )
        await started.wait()
        await asyncio.to_thread(probe.wait_chunks, 1)
        post.cancel()
        with pytest.raises(asyncio.CancelledError):
            await post
    # The proxy dropped its upstream request, and is still serving.
    assert await asyncio.to_thread(probe.upload_disconnected.wait, WAIT)
    async with httpx.AsyncClient(timeout=WAIT) as client:
        r = await client.get(f"{proxy_url}/x", headers=routed(sandbox_id))
    assert r.status_code == 200


async def test_connections_to_the_sandbox_are_kept_alive(proxy_url: str, sandbox_id: str) -> None:
    async with httpx.AsyncClient() as client:
        first = await client.get(f"{proxy_url}/a", headers=routed(sandbox_id))
        no_content = await client.get(f"{proxy_url}/no-content", headers=routed(sandbox_id))
        head = await client.head(f"{proxy_url}/b", headers=routed(sandbox_id))
        after = [await client.get(f"{proxy_url}/c", headers=routed(sandbox_id)) for _ in range(3)]
    assert (no_content.status_code, head.status_code) == (204, 200)
    # After a 204 and a HEAD (no body, whatever Content-Length says), the first request's
    # connection to the sandbox still serves the next ones.
    assert {r.json()["peer"] for r in after} == {first.json()["peer"]}


async def test_kept_alive_connections_belong_to_one_sandbox_run(
    proxy_url: str, resolver: DictResolver, sandbox_id: str, upstream_port: int
) -> None:
    # Another sandbox now at the same address (a reused network slot), and this sandbox after a
    # resume (new incarnation): neither gets a connection opened for someone else.
    resolver.sandboxes["slotreuser0000000001"] = FakeSandbox({USER_PORT: upstream_port})
    try:
        async with httpx.AsyncClient() as client:

            async def peer(sandbox: str) -> int:
                r = await client.get(f"{proxy_url}/p", headers=routed(sandbox))
                return int(r.json()["peer"])

            first = await peer(sandbox_id)
            other = await peer("slotreuser0000000001")
            resolver.sandboxes[sandbox_id].incarnation = "resumed"
            resumed = await peer(sandbox_id)
            again = await peer(sandbox_id)
    finally:
        del resolver.sandboxes["slotreuser0000000001"]
    assert len({first, other, resumed}) == 3
    assert again == resumed


@pytest.fixture
def raw_sandbox(resolver: DictResolver) -> Iterator[str]:
    with raw_server() as port:
        resolver.sandboxes["rawsandbox0000000001"] = FakeSandbox({USER_PORT: port})
        yield "rawsandbox0000000001"
        del resolver.sandboxes["rawsandbox0000000001"]


async def test_unusual_upstream_answers(proxy_url: str, raw_sandbox: str) -> None:
    async with httpx.AsyncClient(timeout=WAIT) as client:
        until_close = await client.get(f"{proxy_url}/until-close", headers=routed(raw_sandbox))
        hints = await client.get(f"{proxy_url}/early-hints", headers=routed(raw_sandbox))
        garbage = await client.get(f"{proxy_url}/garbage", headers=routed(raw_sandbox))
        # A body cut short upstream is cut short for the client too, never silently complete.
        with pytest.raises(httpx.RemoteProtocolError):
            await client.get(f"{proxy_url}/truncated", headers=routed(raw_sandbox))
    assert (until_close.status_code, until_close.text) == (200, "body until close")
    assert (hints.status_code, hints.text) == (200, "ok")
    assert garbage.status_code == 502
    assert garbage.json()["message"] == "The sandbox is running but port is not open"


async def test_a_size_zero_proc_file_reads_whole_and_leaves_the_connection_usable(
    proxy_url: str, envd_port: int
) -> None:
    # /proc files stat as size 0 yet have content: announced as empty, their bytes would overrun
    # the response and the upstream connection, back in the pool, would fail the next request.
    routing = routed(ENVD_SANDBOX, ENVD)
    async with httpx.AsyncClient(timeout=WAIT) as client:
        for attempt in range(6):
            cpuinfo = await client.get(
                f"{proxy_url}/files",
                params={"path": "/proc/cpuinfo", "username": "root"},
                headers=routing,
            )
            assert cpuinfo.status_code == 200
            assert b"processor" in cpuinfo.content
            upload = await client.post(
                f"{proxy_url}/files",
                params={"path": f"/tmp/after-cpuinfo-{attempt}", "username": "root"},
                files={"file": ("f", b"uploaded")},
                headers=routing,
            )
            assert upload.status_code == 200, upload.text


@pytest.mark.parametrize("path", ["/overrun-at-once", "/overrun-later"])
async def test_an_overrun_upstream_connection_is_not_reused(
    proxy_url: str, raw_sandbox: str, path: str
) -> None:
    PLANTED.clear()
    async with httpx.AsyncClient(timeout=WAIT) as client:
        overrun = await client.get(f"{proxy_url}{path}", headers=routed(raw_sandbox))
        assert (overrun.status_code, overrun.content) == (200, b"")
        # Once the planted answer has arrived, the connection it came on must be gone.
        assert await asyncio.to_thread(PLANTED.wait, SAFETY_S)
        # A body: the proxy may not send it again on another connection.
        after = await client.post(
            f"{proxy_url}/until-close", content=b"body", headers=routed(raw_sandbox)
        )
    assert (after.status_code, after.text) == (200, "body until close")


@pytest.fixture(scope="module")
def impatient_proxy_url(resolver: DictResolver) -> Iterator[str]:
    """A proxy that ends an exchange after a second without a byte moving."""
    with serve(SandboxProxy(resolver, domain=DOMAIN, idle_timeout=IDLE), free_port()) as url:
        yield url


IDLE = 1.0


async def test_a_sandbox_that_never_answers_gets_504(
    impatient_proxy_url: str, sandbox_id: str, probe: Probe
) -> None:
    async with httpx.AsyncClient(timeout=WAIT) as client:
        response = await client.get(f"{impatient_proxy_url}/silent", headers=routed(sandbox_id))
    assert response.status_code == 504
    assert response.json()["code"] == 504
    # The sandbox's server saw its client (the proxy) leave.
    assert await asyncio.to_thread(probe.silent_disconnected.wait, WAIT)


def test_a_client_that_stops_reading_is_dropped(
    impatient_proxy_url: str, sandbox_id: str, probe: Probe
) -> None:
    host, port = impatient_proxy_url.removeprefix("http://").split(":")
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        sock.sendall(
            f"GET /endless?flood HTTP/1.1\r\nHost: x\r\nE2b-Sandbox-Id: {sandbox_id}\r\n"
            f"E2b-Sandbox-Port: {USER_PORT}\r\n\r\n".encode()
        )
        # Never read: the proxy's writes back up, then nothing moves for a second.
        assert probe.endless_disconnected.wait(WAIT)


async def test_a_busy_stream_outlives_the_idle_timeout(
    impatient_proxy_url: str, sandbox_id: str
) -> None:
    received = 0
    async with httpx.AsyncClient(timeout=WAIT) as client:
        request = client.stream("GET", f"{impatient_proxy_url}/endless", headers=routed(sandbox_id))
        async with request as response:
            started = asyncio.get_running_loop().time()
            async for chunk in response.aiter_bytes():
                received += len(chunk)
                if asyncio.get_running_loop().time() - started > IDLE * 3:
                    break
    assert received > 0
