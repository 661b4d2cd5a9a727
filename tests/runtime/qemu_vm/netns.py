"""Test-local network plumbing: a namespace with a tap per VM (production uses aenv.network), and
an HTTP client that reaches the guest's fixed IP from inside such a namespace.

Sockets are created inside the namespace by a thread that enters it with setns(2) and leaves at
once; the socket stays bound to that namespace, so the rest of the test runs in the host's.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import secrets
import socket
import subprocess
import time
from typing import Any

from aenv.envd import ENVD_PORT
from aenv.guest.cmdline import GuestNet
from aenv.runtime.driver import NetAttachment

GUEST_NET = GuestNet(address="10.0.2.15/24", gateway="10.0.2.2")
GUEST_IP = "10.0.2.15"
GUEST_MAC = "52:54:00:12:34:56"
GATEWAY_MAC = "52:55:0a:00:02:02"
TAP = "tap0"
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


class NetnsPool:
    """Namespaces `aenvt-<run>-<n>`, each with `tap0` as the guest's gateway; deletes them all."""

    def __init__(self) -> None:
        self.prefix = f"aenvt-{secrets.token_hex(3)}"
        self.names: list[str] = []

    def create(self) -> NetAttachment:
        name = f"{self.prefix}-{len(self.names)}"
        subprocess.run(["ip", "netns", "add", name], check=True)
        self.names.append(name)
        batch = (
            "link set lo up\n"
            f"tuntap add dev {TAP} mode tap\n"
            f"link set {TAP} address {GATEWAY_MAC}\n"
            f"addr add {GUEST_NET.gateway}/24 dev {TAP}\n"
            f"link set {TAP} up\n"
            # As aenv.network does: a permanent neighbour entry spares every first packet to a
            # freshly restored guest an ARP round trip through it.
            f"neigh add {GUEST_IP} lladdr {GUEST_MAC} dev {TAP} nud permanent\n"
        )
        subprocess.run(["ip", "-n", name, "-batch", "-"], input=batch.encode(), check=True)
        return NetAttachment(netns=name, tap=TAP, mac=GUEST_MAC)

    def delete_all(self) -> None:
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
        self.names.clear()


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def socket_in(netns: str) -> socket.socket:
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        _setns(target)
        try:
            return socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        finally:
            _setns(own)
    finally:
        os.close(own)
        os.close(target)


async def http(
    netns: str,
    method: str = "GET",
    path: str = "/",
    *,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    limit_s: float = 30.0,
    connect_limit_s: float | None = None,
    address: str = GUEST_IP,
    port: int = ENVD_PORT,
) -> tuple[int, bytes]:
    """One HTTP/1.0 request to the guest's port 49983 (or to `address:port`), from inside `netns`,
    on the event loop.

    A connect that is not answered quickly is worth retrying (the guest may not run yet), but an
    accepted request must be given time: a loaded TCG guest can take seconds for its first reply,
    and abandoning it only piles more requests onto the guest."""
    lines = [f"{method} {path} HTTP/1.0", f"Host: {address}", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    request = ("\r\n".join(lines) + "\r\n\r\n").encode() + body
    sock = socket_in(netns)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(limit_s) as deadline:
            if connect_limit_s is not None:
                deadline.reschedule(loop.time() + connect_limit_s)
            await loop.sock_connect(sock, (address, port))
            deadline.reschedule(loop.time() + limit_s)
            reader, writer = await asyncio.open_connection(sock=sock)
            writer.write(request)
            raw = await reader.read()
    except TimeoutError as exc:
        raise OSError(f"{method} {path} in {netns}: no answer in {limit_s}s") from exc
    finally:
        # Once a transport owns the socket, only it may close it: a socket closed under a live
        # transport frees its fd number while the loop still watches it, and the next socket
        # given that number fails ("File descriptor N is used by transport").
        if writer is not None:
            writer.close()
        else:
            sock.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    parts = head.split(b" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        raise OSError(f"{method} {path} in {netns}: malformed response {head[:80]!r}")
    if b"transfer-encoding: chunked" in head.lower():
        payload = _dechunk(payload)
    return int(parts[1]), payload


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += rest[:size]
        data = rest[size + 2 :]
    return bytes(out)


async def agent(netns: str, method: str = "GET", path: str = "/", **kwargs: Any) -> Any:
    """A request to the stand-in agent, which answers JSON with status 200."""
    status, payload = await http(netns, method, path, **kwargs)
    if status != 200:
        raise RuntimeError(f"{method} {path}: HTTP {status}")
    return json.loads(payload)


async def wait_ready(netns: str, limit_s: float = 120.0) -> float:
    """Seconds until the guest agent answers (a new attempt 10 ms after each failed one)."""
    start = time.monotonic()
    while True:
        with contextlib.suppress(OSError, RuntimeError, ValueError):
            await agent(netns, connect_limit_s=0.5)
            return time.monotonic() - start
        if time.monotonic() - start > limit_s:
            raise TimeoutError(f"guest agent in {netns} not ready after {limit_s:.0f}s")
        await asyncio.sleep(0.01)
