"""TCP servers and clients bound to a network namespace, for checking what reaches what.

A socket belongs to the namespace it was created in, so each one is made on a thread inside the
namespace (`netns.run_in`) and then driven from the event loop like any other socket. Default
timeouts are long: they only cost time when a connection that should work does not (checks of
what must be unreachable pass short ones), and a loaded machine must not fail a working path.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

from aenv.network import netns


async def ns_socket(ns: str) -> socket.socket:
    def make() -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        return sock

    return await netns.run_in(ns, make)


async def serve(ns: str, ip: str, port: int, name: str) -> asyncio.Server:
    """A server that greets each client with `<name> <client ip>` and then echoes lines."""

    async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")[0]
        writer.write(f"{name} {peer}\n".encode())
        with contextlib.suppress(ConnectionError):
            while line := await reader.readline():
                writer.write(line)
                await writer.drain()
        writer.close()

    sock = await ns_socket(ns)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((ip, port))
    return await asyncio.start_server(greet, sock=sock)


async def connect(
    ns: str, ip: str, port: int, timeout: float = 5.0
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str] | None:
    """Connect from `ns`; the open streams and the server's greeting, or None if unreachable."""
    sock = await ns_socket(ns)
    try:
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (ip, port)), timeout)
    except (OSError, TimeoutError):
        sock.close()
        return None
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        greeting = await asyncio.wait_for(reader.readline(), timeout)
    except (OSError, TimeoutError):
        greeting = b""
    if not greeting:
        writer.close()
        return None
    return reader, writer, greeting.decode().strip()


async def probe(ns: str, ip: str, port: int, timeout: float = 5.0) -> str | None:
    """The greeting of the server at ip:port as seen from `ns`, or None if it cannot be reached."""
    conn = await connect(ns, ip, port, timeout)
    if conn is None:
        return None
    conn[1].close()
    return conn[2]


async def echo(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter, str], timeout: float = 1.0
) -> bool:
    """Whether an already open connection still carries a line both ways."""
    reader, writer, _ = conn
    try:
        writer.write(b"ping\n")
        await writer.drain()
        return await asyncio.wait_for(reader.readline(), timeout) == b"ping\n"
    except (OSError, TimeoutError):
        return False
