"""The host name a client asks for in the first bytes of a connection: TLS SNI or HTTP `Host`.

Both are parsed by the libraries that parse them for real servers, not by hand: OpenSSL reads
the ClientHello (a server-side `SSLObject` over memory buffers whose SNI callback records the
name and then aborts the handshake), httptools reads the HTTP request head.
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


def requested_name(data: bytes) -> str | Need | None:
    """The name in a TLS ClientHello or an HTTP request head; None when `data` is neither or
    names nothing; `Need.MORE` when it may be one but is cut short."""
    if not data:
        return Need.MORE
    if data[0] == _TLS_HANDSHAKE:
        return tls_server_name(data)
    return http_host(data)
