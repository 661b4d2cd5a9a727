"""The node's port as uvicorn serves it with our settings, on loopback: a request head that
does not arrive in time and connections past the cap are cut off, while normal requests and
kept-alive connections are served."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from aenv.config import Config
from aenv.serving import uvicorn_config
from tests.support.ports import free_port

# Only keeps a broken server from hanging the suite; nothing is timed against it.
WAIT = 20.0


async def _hello(_: Request) -> PlainTextResponse:
    return PlainTextResponse("hello")


async def _length(request: Request) -> PlainTextResponse:
    return PlainTextResponse(str(len(await request.body())))


@contextmanager
def _served(config: Config) -> Iterator[tuple[str, int]]:
    app = Starlette(routes=[Route("/", _hello), Route("/length", _length, methods=["POST"])])
    server = uvicorn.Server(uvicorn_config(app, config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + WAIT
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        yield config.host, config.port
    finally:
        server.should_exit = True
        thread.join(WAIT)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[str, int]]:
    config = Config(
        home=tmp_path, host="127.0.0.1", port=free_port(), header_timeout=1, max_connections=4
    )
    with _served(config) as address:
        yield address


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closes `sock` (read until EOF, or WAIT seconds of silence)."""
    sock.settimeout(WAIT)
    try:
        while sock.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("sent", [b"", b"GET / HTTP/1.1\r\nHost: x\r\n"])
def test_a_request_head_that_does_not_arrive_is_cut_off(node: tuple[str, int], sent: bytes) -> None:
    with socket.create_connection(node) as sock:
        sock.sendall(sent)
        assert _closed_by_server(sock)


def test_connections_past_the_cap_are_refused(node: tuple[str, int]) -> None:
    held = [socket.create_connection(node) for _ in range(4)]
    try:
        for sock in held:  # each one answered: all four are in
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200 OK")
        with socket.create_connection(node) as extra:
            assert _closed_by_server(extra)
    finally:
        for sock in held:
            sock.close()
    # Freed places are taken again.
    deadline = time.monotonic() + WAIT
    while True:
        try:
            assert httpx.get(f"http://{node[0]}:{node[1]}/", timeout=WAIT).text == "hello"
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


async def test_kept_alive_connections_serve_many_requests(node: tuple[str, int]) -> None:
    async with httpx.AsyncClient(base_url=f"http://{node[0]}:{node[1]}") as client:
        for _ in range(3):
            assert (await client.get("/")).text == "hello"
            await asyncio.sleep(0.6)  # idle, but not a request in progress: not cut off
        assert (await client.get("/")).text == "hello"


def _head(size: int, upgrade: bool = False) -> bytes:
    """A GET whose head is `size` bytes."""
    start = b"GET / HTTP/1.1\r\nHost: x\r\n"
    if upgrade:
        start += b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
        start += b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    filler = size - len(start) - len(b"X-Big: \r\n\r\n")
    head = start + b"X-Big: " + b"a" * filler + b"\r\n\r\n"
    assert len(head) == size
    return head


# A head arriving in one read with its end was not counted: up to two reads' worth passed.
@pytest.mark.parametrize(
    ("head", "then"),
    [
        (_head(1 << 20), b""),
        (_head(64 * 1024 + 1), b""),
        (_head(100 * 1024), b""),
        (_head(127 * 1024), b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),  # pipelined: not served
        (_head(100 * 1024, upgrade=True), b""),
    ],
    ids=["1 MiB", "64 KiB + 1", "100 KiB", "127 KiB and another request", "websocket"],
)
def test_an_oversized_request_head_is_refused(
    node: tuple[str, int], head: bytes, then: bytes
) -> None:
    with socket.create_connection(node) as sock:
        sock.settimeout(WAIT)
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            sock.sendall(head + then)
        answer = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(4096):
                answer += chunk
    assert answer.startswith(b"HTTP/1.1 431 ")
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert body == {"code": 431, "message": "request head larger than 65536 bytes"}


def test_a_request_that_does_not_parse_gets_a_json_400(node: tuple[str, int]) -> None:
    """Schemathesis found uvicorn's plain-text answer to a malformed content-length."""
    with socket.create_connection(node) as sock:
        sock.settimeout(WAIT)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\ncontent-length: b<9k\r\n\r\n")
        answer = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(4096):
                answer += chunk
    assert answer.startswith(b"HTTP/1.1 400 ")
    head, body = answer.split(b"\r\n\r\n", 1)
    assert b"content-type: application/json" in head
    assert json.loads(body) == {"code": 400, "message": "Invalid HTTP request received."}


def test_a_head_at_the_limit_is_served(node: tuple[str, int]) -> None:
    with socket.create_connection(node) as sock:
        sock.settimeout(WAIT)
        sock.sendall(_head(64 * 1024))
        assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")


@pytest.mark.parametrize("writes", ["together", "head first", "two requests"])
def test_a_big_body_is_not_a_big_head(node: tuple[str, int], writes: str) -> None:
    body = b"x" * (200 * 1024)
    with socket.create_connection(node) as sock:
        sock.settimeout(WAIT)
        head = f"POST /length HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
        if writes == "together":  # the head arrives in one read with the start of the body
            sock.sendall(head.encode() + body)
        elif writes == "two requests":  # a kept-alive connection: the second read is whole
            sock.sendall(head.encode() + body)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")
            sock.sendall(head.encode() + body)
        else:  # the body's last read (which completes the request) is far bigger than a head
            sock.sendall(head.encode())
            time.sleep(0.2)
            sock.sendall(body)
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(str(len(body)).encode())


async def test_big_bodies_on_a_kept_alive_connection(node: tuple[str, int]) -> None:
    # What the e2e bad-input suite sends: reads that finish a body are bigger than any head.
    async with httpx.AsyncClient(base_url=f"http://{node[0]}:{node[1]}", timeout=WAIT) as client:
        for _ in range(10):
            response = await client.post("/length", json={"envVars": {"BIG": "x" * (256 << 10)}})
            assert response.status_code == 200, response.text
