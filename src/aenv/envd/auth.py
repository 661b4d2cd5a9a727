"""Access-token checks and signed `/files` URLs, exactly as the E2B SDKs expect.

With a token configured (`POST /init`), every request but `GET /health`, `GET`/`POST /files` and
`POST /init` needs `X-Access-Token`. `/files` accepts the header or a URL signature:
`v1_` + base64(sha256("path:operation:username:token[:expiration]")) without padding.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time

TOKEN_HEADER = "x-access-token"  # noqa: S105 - a header name
UNAUTHORIZED_MESSAGE = (
    "unauthorized access, please provide a valid access token or method signing if supported"
)
_OPEN_ROUTES = frozenset(
    {("GET", "/health"), ("GET", "/files"), ("POST", "/files"), ("POST", "/init")}
)


class SignatureError(Exception):
    """A `/files` request whose signature (or header token) does not authorize it."""


def tokens_equal(expected: str, given: str | None) -> bool:
    return given is not None and hmac.compare_digest(expected.encode(), given.encode())


def route_needs_token(method: str, path: str) -> bool:
    return (method, path) not in _OPEN_ROUTES


def sign(path: str, operation: str, username: str, token: str, expiration: int | None) -> str:
    parts = [path, operation, username, token]
    if expiration is not None:
        parts.append(str(expiration))
    digest = hashlib.sha256(":".join(parts).encode()).digest()
    return "v1_" + base64.b64encode(digest).decode().rstrip("=")


def check_file_access(
    token: str | None,
    header_token: str | None,
    *,
    path: str,
    operation: str,
    username: str | None,
    signature: str | None,
    expiration: str | None,
) -> None:
    """Raise SignatureError unless the request may read/write `path` (raw query value)."""
    if token is None:
        return
    if header_token:
        if not tokens_equal(token, header_token):
            raise SignatureError("access token present in header but does not match")
        return
    if signature is None:
        raise SignatureError("missing signature query parameter")
    try:
        exp = int(expiration) if expiration is not None else None
    except ValueError:
        raise SignatureError("invalid signature expiration") from None
    expected = sign(path, operation, username or "", token, exp)
    if not hmac.compare_digest(expected.encode(), signature.encode()):
        raise SignatureError("invalid signature")
    if exp is not None and exp < time.time():
        raise SignatureError("signature is already expired")
