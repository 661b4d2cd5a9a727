"""A sandbox run that ends (its VM stopped) ends every exchange with it at once: an unanswered
request gets the proxy's 'sandbox not found', an answer under way is cut, a WebSocket closes.
The proxy is served by uvicorn in the test's own event loop, as the server runs it beside the
orchestrator."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import uvicorn
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from aenv.proxy import SandboxProxy
from tests.proxy.conftest import USER_PORT
from tests.proxy.support import WAIT, DictResolver, FakeSandbox, Probe, serve, upstream_app
from tests.support.ports import free_port

SANDBOX = "runsandbox0000000001"
RUN = "run-1"


@pytest.fixture
def run_probe() -> Probe:
    return Probe()


@pytest.fixture
def upstream(run_probe: Probe) -> Iterator[int]:
    port = free_port()
    with serve(upstream_app(run_probe), port):
        yield port


@pytest.fixture
async def proxy(upstream: int) -> AsyncIterator[tuple[SandboxProxy, str]]:
    resolver = DictResolver({SANDBOX: FakeSandbox({USER_PORT: upstream}, incarnation=RUN)})
    app = SandboxProxy(resolver)
    # TCP named, so that asyncio sets TCP_NODELAY (see tests/support/loopback_api.py).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, lifespan="off", log_level="warning", http="httptools")
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    await server.startup(sockets=[sock])
    try:
        yield app, f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await server.shutdown()
        await app.aclose()
        sock.close()


HEADERS = {"E2b-Sandbox-Id": SANDBOX, "E2b-Sandbox-Port": str(USER_PORT)}


async def _when(event: object) -> None:
    assert await asyncio.to_thread(event.wait, WAIT)  # type: ignore[attr-defined]


async def test_an_unanswered_request_ends_as_sandbox_not_found(
    proxy: tuple[SandboxProxy, str], run_probe: Probe
) -> None:
    app, address = proxy
    async with httpx.AsyncClient(timeout=WAIT) as client:
        pending = asyncio.create_task(client.get(f"http://{address}/silent", headers=HEADERS))
        await _when(run_probe.silent_started)
        app.end_run(SANDBOX, "another-run")  # another run of it: nothing to end
        await asyncio.sleep(0.2)
        assert not pending.done()
        app.end_run(SANDBOX, RUN)
        response = await pending
    assert response.status_code == 502
    assert response.json()["message"] == "The sandbox was not found"
    await _when(run_probe.silent_disconnected)  # the upstream request was ended too


async def test_an_answer_under_way_is_cut(
    proxy: tuple[SandboxProxy, str], run_probe: Probe, caplog: pytest.LogCaptureFixture
) -> None:
    app, address = proxy
    url = f"http://{address}/endless"
    # uvicorn's loggers do not propagate to the root, where caplog listens.
    logging.getLogger("uvicorn.error").addHandler(caplog.handler)
    try:
        async with (
            httpx.AsyncClient(timeout=WAIT) as client,
            client.stream("GET", url, headers=HEADERS) as response,
        ):
            assert response.status_code == 200
            chunks = response.aiter_bytes()
            await anext(chunks)
            app.end_run(SANDBOX, RUN)
            with pytest.raises(httpx.RemoteProtocolError):
                async for _ in chunks:
                    pass
        await _when(run_probe.endless_disconnected)
        async with asyncio.timeout(WAIT):
            while app.quiet_since(SANDBOX) is None:
                await asyncio.sleep(0.01)
    finally:
        logging.getLogger("uvicorn.error").removeHandler(caplog.handler)
    # Cut on purpose: not logged as an application error by uvicorn.
    assert [r.getMessage() for r in caplog.records if "ASGI callable" in r.getMessage()] == []


async def test_a_websocket_is_closed(proxy: tuple[SandboxProxy, str]) -> None:
    app, address = proxy
    async with connect(
        f"ws://{address}/ws", additional_headers=HEADERS, open_timeout=WAIT
    ) as websocket:
        await websocket.recv()  # the upstream's greeting: the bridge is up
        app.end_run(SANDBOX, RUN)
        with pytest.raises(ConnectionClosed) as closed:
            async with asyncio.timeout(WAIT):
                while True:
                    await websocket.recv()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1011


async def test_quiet_since_is_none_while_a_stream_is_open(
    proxy: tuple[SandboxProxy, str], run_probe: Probe
) -> None:
    """What idle hibernation asks: an open stream keeps a sandbox busy; once it ends, the
    sandbox has been quiet since then."""
    app, address = proxy
    assert app.quiet_since(SANDBOX) == 0.0  # no exchange yet
    async with (
        httpx.AsyncClient(timeout=WAIT) as client,
        client.stream("GET", f"http://{address}/endless", headers=HEADERS) as response,
    ):
        await anext(response.aiter_bytes())
        assert app.quiet_since(SANDBOX) is None
    await _when(run_probe.endless_disconnected)
    for _ in range(100):  # the proxy sees the client go when its next write fails
        if app.quiet_since(SANDBOX) is not None:
            break
        await asyncio.sleep(0.05)
    ended = app.quiet_since(SANDBOX)
    assert ended is not None and ended > 0.0
