"""Applying header rules to a guest's HTTPS connection: the slot's egress proxy terminates the
guest's TLS with a certificate of the node's CA (`egress_ca`), opens its own verified TLS
connection to the server, and relays HTTP/1.1 requests between them, setting each request's
headers as the rules for the connection's name say (`header_rules`).

1. The guest's ClientHello, already read to find the name, is fed to an `ssl.SSLObject` over
   memory buffers (`GuestTls`); the proxy runs that handshake while it verifies the server.
2. `exchange` parses both sides with h11: requests from the guest (headers set by the rules,
   bodies streamed), responses from the server (streamed), keep-alive cycles, 1xx responses.
   A protocol switch (WebSocket upgrade, CONNECT) turns the rest of the connection into a
   byte relay, once both sides agreed to it.

This is the guest's side when it speaks HTTP/1.1; one that speaks HTTP/2 (ALPN) is served by
`interception_h2`. The server's side is always HTTP/1.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import h11

from aenv.network.header_rules import HeadersNow, apply

_CHUNK = 256 * 1024
# The largest request or response head h11 buffers (its own default is 16 KiB).
_MAX_HEAD = 64 * 1024


class Stream(Protocol):
    @property
    def alpn(self) -> str | None:
        """The protocol agreed by ALPN (None: none, or not TLS)."""

    async def read(self) -> bytes: ...

    async def write(self, data: bytes) -> None: ...


class PlainStream:
    """An asyncio stream pair as a `Stream`; `alpn` is what its TLS agreed on, if any."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, alpn: str | None = None
    ) -> None:
        self._reader, self._writer = reader, writer
        self.alpn = alpn

    async def read(self) -> bytes:
        return await self._reader.read(_CHUNK)

    async def write(self, data: bytes) -> None:
        self._writer.write(data)
        await self._writer.drain()


class GuestTls:
    """The server side of TLS over a guest's connection whose first bytes (`head`) were
    already read from `reader`."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        context: ssl.SSLContext,
        head: bytes,
    ) -> None:
        self._reader, self._writer = reader, writer
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._incoming.write(head)
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=True)

    async def _flush(self) -> None:
        if data := self._outgoing.read():
            self._writer.write(data)
            await self._writer.drain()

    async def _fill(self) -> None:
        data = await self._reader.read(_CHUNK)
        if data:
            self._incoming.write(data)
        else:
            self._incoming.write_eof()

    @property
    def alpn(self) -> str | None:
        """The protocol the guest and the proxy agreed on (after the handshake)."""
        return self._tls.selected_alpn_protocol()

    async def handshake(self) -> None:
        """Raises ssl.SSLError (or OSError) if the guest does not complete it."""
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush()
                await self._fill()
        await self._flush()

    async def read(self) -> bytes:
        while True:
            try:
                return self._tls.read(_CHUNK)
            except ssl.SSLWantReadError:
                await self._flush()
                await self._fill()
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""

    async def write(self, data: bytes) -> None:
        self._tls.write(data)
        await self._flush()


async def _next_event(conn: h11.Connection, stream: Stream) -> object:
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(await stream.read())


async def _send(conn: h11.Connection, stream: Stream, event: h11.Event) -> None:
    data = conn.send(event)
    if data:
        await stream.write(data)


async def _upload(guest: h11.Connection, down: Stream, server: h11.Connection, up: Stream) -> None:
    """A request's body, from the guest to the server."""
    while True:
        event = await _next_event(guest, down)
        if isinstance(event, h11.Data):
            await _send(server, up, h11.Data(data=event.data))
        elif isinstance(event, h11.EndOfMessage):
            await _send(server, up, h11.EndOfMessage(headers=event.headers))
            return
        else:  # the guest went away mid-body
            raise ConnectionError("request cut short")


def closes(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether a message's `Connection` header ends the connection after it."""
    return any(
        name == b"connection" and b"close" in (token.strip().lower() for token in value.split(b","))
        for name, value in headers
    )


def raw_length(request: h11.Request, response: h11.Response) -> int | None:
    """The length of `response`'s body if Content-Length alone frames it, to the guest as from
    the server (both HTTP/1.1), so that its bytes can go on as they come rather than through
    h11 (which copies them twice); None for any other framing."""
    if request.method in (b"HEAD", b"CONNECT") or request.http_version != b"1.1":
        return None
    if response.http_version != b"1.1" or response.status_code in (204, 304):
        return None
    lengths = [value for name, value in response.headers if name == b"content-length"]
    if len(lengths) != 1 or any(name == b"transfer-encoding" for name, _ in response.headers):
        return None
    return int(lengths[0])  # h11 checked it is digits


@dataclass(frozen=True)
class _Spliced:
    """A response whose body went to the guest as raw bytes: h11 saw its head only. `leftover`
    is what the server sent past the body, `keep_alive` whether the connections go on."""

    leftover: bytes
    keep_alive: bool


async def splice(
    server: h11.Connection, up: Stream, send: Callable[[bytes], Awaitable[None]], length: int
) -> bytes:
    """`length` bytes of body, from what h11 read ahead and then the server, to `send`; what
    was read past them."""
    ahead = server.trailing_data[0]
    chunk, leftover = ahead[:length], ahead[length:]
    while True:
        if chunk:
            await send(chunk)
            length -= len(chunk)
        if length == 0:
            return leftover
        chunk = await up.read()
        if not chunk:
            raise ConnectionError("response cut short")
        if len(chunk) > length:
            chunk, leftover = chunk[:length], chunk[length:]


async def _download(
    server: h11.Connection,
    up: Stream,
    guest: h11.Connection,
    down: Stream,
    request: h11.Request,
    upload: asyncio.Future[None],
) -> _Spliced | None:
    """The server's response (with any 1xx before it), to the guest. A body framed by length
    alone, once the request's has gone, goes on as raw bytes (`_Spliced`)."""
    while True:
        event = await _next_event(server, up)
        if isinstance(event, h11.InformationalResponse | h11.Response):
            # Made anew: h11 sends only HTTP/1.1, whatever version the server spoke.
            head = type(event)(
                status_code=event.status_code,
                headers=list(event.headers.raw_items()),
                reason=event.reason,
            )
            await _send(guest, down, head)
            if event.status_code == 101:
                return None
            if isinstance(event, h11.Response) and upload.done():
                length = raw_length(request, event)
                if length is not None:
                    leftover = await splice(server, up, down.write, length)
                    keep_alive = not (closes(request.headers) or closes(event.headers))
                    return _Spliced(leftover, keep_alive)
        elif isinstance(event, h11.Data):
            await _send(guest, down, h11.Data(data=event.data))
        elif isinstance(event, h11.EndOfMessage):
            await _send(guest, down, h11.EndOfMessage(headers=event.headers))
            return None
        elif event is h11.PAUSED:  # a 2xx answer to CONNECT
            return None
        else:
            raise ConnectionError("response cut short")


async def _pipe(source: Stream, sink: Stream) -> None:
    while data := await source.read():
        await sink.write(data)


async def _switched(
    guest: h11.Connection, down: Stream, server: h11.Connection, up: Stream
) -> None:
    """Relay bytes once both sides switched protocols, starting with what h11 read ahead."""
    if early := guest.trailing_data[0]:
        await up.write(early)
    if early := server.trailing_data[0]:
        await down.write(early)
    await asyncio.gather(_pipe(down, up), _pipe(up, down))


def _done(*conns: h11.Connection) -> bool:
    return all(c.our_state is h11.DONE and c.their_state is h11.DONE for c in conns)


def connection(
    role: type[h11.SERVER] | type[h11.CLIENT], data: bytes, ended: bool
) -> h11.Connection:
    """A new h11 state for one side, having received `data` (and its end if `ended`)."""
    conn = h11.Connection(role, max_incomplete_event_size=_MAX_HEAD)
    if data:  # h11 takes b"" for the end
        conn.receive_data(data)
    if ended:
        conn.receive_data(b"")
    return conn


async def exchange(down: Stream, up: Stream, rule_headers: HeadersNow) -> None:
    """Relay HTTP/1.1 between the guest (`down`) and the server (`up`) until either ends,
    every request sent with the headers `rule_headers()` gives then. Raises h11.ProtocolError
    for what is not HTTP/1.1, and OSError or ConnectionError when a side goes away
    mid-message or `rule_headers` has none to give (`SecretUnavailable`: nothing is sent)."""
    guest = connection(h11.SERVER, b"", False)
    server = connection(h11.CLIENT, b"", False)
    while True:
        request = await _next_event(guest, down)
        if not isinstance(request, h11.Request):
            return
        headers = apply(list(request.headers.raw_items()), rule_headers())
        await _send(
            server,
            up,
            h11.Request(
                method=request.method,
                target=request.target,
                headers=headers,
                http_version=request.http_version,
            ),
        )
        upload = asyncio.ensure_future(_upload(guest, down, server, up))
        try:
            spliced = await _download(server, up, guest, down, request, upload)
            await upload
        finally:
            upload.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await upload
        if spliced is not None:
            # h11 saw neither body: each side starts anew, with what it read ahead.
            if not spliced.keep_alive:
                return
            guest = connection(h11.SERVER, *guest.trailing_data)
            server = connection(h11.CLIENT, spliced.leftover, server.trailing_data[1])
            continue
        switched = h11.SWITCHED_PROTOCOL
        if guest.our_state is switched and server.their_state is switched:
            await _switched(guest, down, server, up)
            return
        if not _done(guest, server):
            return
        guest.start_next_cycle()
        server.start_next_cycle()
