"""The host name a client asks for in the first bytes of a connection: TLS SNI or HTTP `Host`.

Both are parsed by the libraries that parse them for real servers, not by hand: OpenSSL reads
the ClientHello (a server-side `SSLObject` over memory buffers whose SNI callback records the
name and then aborts the handshake), httptools reads the HTTP request head. The protocols a
ClientHello offers by ALPN (`tls_alpn`) are read here by hand, since OpenSSL shows a server only
the one it picks; they only choose what the proxy offers the server in turn, never who is let
through.
"""

from __future__ import annotations

import ssl
from contextvars import ContextVar
from enum import Enum

import httptools

_TLS_HANDSHAKE = 0x16


class Need(Enum):
    """Not decided yet: more bytes are needed."""

    MORE = "more"


# The SNI callback runs inside `do_handshake`, on the caller's thread and context.
_seen: ContextVar[list[str | None]] = ContextVar("sni_seen")


def _record_sni(_: object, name: str | None, __: ssl.SSLContext) -> int:
    _seen.get().append(name)
    return ssl.ALERT_DESCRIPTION_HANDSHAKE_FAILURE


def _sni_context() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.sni_callback = _record_sni
    return context


_SNI = _sni_context()


def tls_server_name(data: bytes) -> str | Need | None:
    incoming = ssl.MemoryBIO()
    incoming.write(data)
    conn = _SNI.wrap_bio(incoming, ssl.MemoryBIO(), server_side=True)
    seen: list[str | None] = []
    token = _seen.set(seen)
    try:
        conn.do_handshake()
    except ssl.SSLWantReadError:
        return Need.MORE
    except ssl.SSLError:
        pass
    finally:
        _seen.reset(token)
    return seen[0] if seen else None


class _Head:
    def __init__(self) -> None:
        self.host: str | None = None
        self.done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"host" and self.host is None:
            self.host = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.done = True


def http_host(data: bytes) -> str | Need | None:
    head = _Head()
    parser = httptools.HttpRequestParser(head)
    try:
        parser.feed_data(data)
    except httptools.HttpParserUpgrade:
        pass
    except httptools.HttpParserError:
        return None
    if not head.done:
        return Need.MORE
    if head.host is None:
        return None
    host = head.host
    # `name:port`, or `[v6]:port`.
    return host.rsplit(":", 1)[0] if not host.endswith("]") else host


def _handshake_bytes(data: bytes) -> bytes:
    """The handshake messages in `data`'s TLS records (a ClientHello may span several)."""
    out, at = bytearray(), 0
    while at + 5 <= len(data) and data[at] == _TLS_HANDSHAKE:
        length = int.from_bytes(data[at + 3 : at + 5], "big")
        out += data[at + 5 : at + 5 + length]
        at += 5 + length
    return bytes(out)


def tls_alpn(data: bytes) -> tuple[str, ...]:
    """The protocols the ClientHello in `data` offers by ALPN, in its order; () for none, or
    for what is not a whole ClientHello."""
    hello = _handshake_bytes(data)
    if len(hello) < 4 or hello[0] != 1:  # client_hello
        return ()
    end = min(len(hello), 4 + int.from_bytes(hello[1:4], "big"))
    at = 4 + 2 + 32  # version, random
    try:
        at += 1 + hello[at]  # session id
        at += 2 + int.from_bytes(hello[at : at + 2], "big")  # cipher suites
        at += 1 + hello[at]  # compression methods
        extensions_end = min(end, at + 2 + int.from_bytes(hello[at : at + 2], "big"))
        at += 2
        while at + 4 <= extensions_end:
            kind = int.from_bytes(hello[at : at + 2], "big")
            length = int.from_bytes(hello[at + 2 : at + 4], "big")
            body = hello[at + 4 : at + 4 + length]
            at += 4 + length
            if kind != 16:  # application_layer_protocol_negotiation
                continue
            names, pos = [], 2
            while pos < len(body):
                size = body[pos]
                names.append(body[pos + 1 : pos + 1 + size].decode("ascii", "replace"))
                pos += 1 + size
            return tuple(names)
    except IndexError:
        return ()
    return ()


def requested_name(data: bytes) -> str | Need | None:
    """The name in a TLS ClientHello or an HTTP request head; None when `data` is neither or
    names nothing; `Need.MORE` when it may be one but is cut short."""
    if not data:
        return Need.MORE
    if data[0] == _TLS_HANDSHAKE:
        return tls_server_name(data)
    return http_host(data)
