"""Which headers cross the proxy (RFC 9110 7.6.1: hop-by-hop headers stop at each hop).

Everything end-to-end is forwarded unchanged, including `Host` (as infra does: a web server in the
sandbox sees the name the client used) and the E2B routing and token headers: envd ignores
`E2b-Sandbox-Id`/`-Port`, and a user service may want to know its sandbox. Framing is redone per
hop: uvicorn hands us de-chunked bodies and our upstream client re-frames them. Trailers are not
forwarded (ASGI servers do not pass them; Connect over HTTP/1.1 ends its streams in the body).
"""

from __future__ import annotations

from collections.abc import Iterable

# `expect` too: uvicorn has already answered `100-continue` when the body is first read.
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"expect",
    }
)
# A WebSocket handshake is redone by the upstream client, which sets these itself.
_WEBSOCKET_HANDSHAKE = frozenset(
    {
        b"host",
        b"sec-websocket-key",
        b"sec-websocket-version",
        b"sec-websocket-extensions",
        b"sec-websocket-protocol",
        b"sec-websocket-accept",
    }
)


def _listed_in_connection(headers: Iterable[tuple[bytes, bytes]]) -> frozenset[bytes]:
    # Headers named in `Connection` are hop-by-hop too (RFC 9110 7.6.1).
    return frozenset(
        token.strip().lower()
        for name, value in headers
        if name.lower() == b"connection"
        for token in value.split(b",")
    )


def end_to_end(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """`headers` (lower-cased names) without hop-by-hop ones."""
    listed = _listed_in_connection(headers)
    return [(n, v) for n, v in headers if n not in _HOP_BY_HOP and n not in listed]


def request_headers(
    headers: list[tuple[bytes, bytes]],
) -> tuple[list[tuple[bytes, bytes]], bool, bool]:
    """The headers to send upstream for an ASGI request's `headers`, whether the request has a
    body, and whether it is chunked. A chunked request stays chunked; a `Content-Length` is
    kept as is."""
    forwarded = end_to_end(headers)
    if any(n == b"transfer-encoding" for n, _ in headers):
        # Transfer-Encoding overrides Content-Length (RFC 9112 6.3); send only the one in force.
        forwarded = [(n, v) for n, v in forwarded if n != b"content-length"]
        forwarded.append((b"transfer-encoding", b"chunked"))
        return forwarded, True, True
    length = next((v for n, v in forwarded if n == b"content-length"), b"0")
    return forwarded, length.strip() not in (b"", b"0"), False


def response_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The headers to send to the client for an upstream response's `headers` (any case).
    `Date` is dropped because uvicorn adds its own to every response."""
    lowered = [(n.lower(), v) for n, v in headers]
    return [(n, v) for n, v in end_to_end(lowered) if n != b"date"]


def websocket_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    """The extra headers for the upstream WebSocket handshake, as the `websockets` client takes
    them; the subprotocols travel separately."""
    return [
        (n.decode("latin-1"), v.decode("latin-1"))
        for n, v in end_to_end(headers)
        if n not in _WEBSOCKET_HANDSHAKE
    ]


def masked(headers: list[tuple[bytes, bytes]], host: str) -> list[tuple[bytes, bytes]]:
    """`headers` with `Host` replaced by `host` and the client's in `X-Forwarded-Host` (a client's
    own `X-Forwarded-Host` is dropped: it would claim another origin)."""
    client_host = next((v for n, v in headers if n == b"host"), None)
    kept = [(n, v) for n, v in headers if n not in (b"host", b"x-forwarded-host")]
    kept.append((b"host", host.encode("latin-1")))
    if client_host is not None:
        kept.append((b"x-forwarded-host", client_host))
    return kept
