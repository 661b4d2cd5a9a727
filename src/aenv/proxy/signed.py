"""Signed file URLs that name no sandbox: which sandbox's envd they are for.

With `E2B_SANDBOX_URL` naming the node, the SDKs' `download_url()` and `upload_url()` give
`<node>/files?path=...&signature=v1_...`: no sandbox id in the host, path or headers, so a browser
or `urllib` fetch of it could not be routed. The signature is the sha256 of the path, operation,
user and the sandbox's envd access token (`aenv.envd.auth.sign`), and each sandbox has a token of
its own, so exactly one sandbox's token makes it: the request goes to that sandbox's envd, which
checks the signature (and its expiry) again itself. A signature no token makes is not routed.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import parse_qs

from starlette.types import Scope

from aenv.envd import ENVD_PORT
from aenv.envd.auth import sign
from aenv.proxy.routing import Target

FILES_PATH = "/files"
# envd's operation for each method of `/files`, as the SDKs sign them.
_OPERATIONS = {"GET": "read", "POST": "write"}


@dataclass(frozen=True, slots=True)
class SignedFile:
    """What a signed `/files` request was signed over."""

    path: str
    operation: str
    username: str
    signature: str
    expiration: int | None


def signed_file(scope: Scope) -> SignedFile | None:
    """The signed `/files` request `scope` is, or None (another request, or no signature)."""
    operation = _OPERATIONS.get(scope.get("method", ""))
    if scope["type"] != "http" or scope["path"] != FILES_PATH or operation is None:
        return None
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    signature = query.get("signature", [None])[0]
    if signature is None:
        return None
    raw_expiration = query.get("signature_expiration", [None])[0]
    try:
        expiration = int(raw_expiration) if raw_expiration is not None else None
    except ValueError:
        return None
    return SignedFile(
        query.get("path", [""])[0],
        operation,
        query.get("username", [""])[0],
        signature,
        expiration,
    )


def signer(signed: SignedFile, tokens: Iterable[tuple[str, str | None]]) -> str | None:
    """The sandbox among `tokens` (sandbox id, envd access token) whose token signed `signed`."""
    given = signed.signature.encode()
    for sandbox_id, token in tokens:
        if token is None:
            continue
        expected = sign(signed.path, signed.operation, signed.username, token, signed.expiration)
        if hmac.compare_digest(expected.encode(), given):
            return sandbox_id
    return None


def envd_target(sandbox_id: str, scope: Scope) -> Target:
    path: str = scope["path"]
    return Target(sandbox_id, ENVD_PORT, path, scope.get("raw_path") or path.encode())
