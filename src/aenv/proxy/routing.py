"""Which requests are data-plane traffic, and for which sandbox and port.

A pure function of the ASGI scope, so the one-port server can ask it before deciding between the
control plane and the proxy. Three ways to address a sandbox, tried in this order:

1. Headers `E2b-Sandbox-Id` + `E2b-Sandbox-Port`: what the SDKs send on every envd and code
   interpreter call. They win over the path because envd and the control plane share paths
   (`/health`, `/metrics`), and over the host because the SDK sends them even to
   `{port}-{id}.{domain}`, where both agree (e2b-protocol.md 1.6 A).
2. Host `{port}-{id}.{domain}`: wildcard DNS (1.6 B), browsers, `sandbox.get_host(port)`. Only
   when the host is a subdomain of the configured domain, so `api.{domain}` stays control plane.
   `{port}-{id}.localhost` is routed with or without a configured domain: `aenv auth` sets
   `E2B_DOMAIN=localhost:<port>` so that `get_host` names the node rather than E2B's cloud,
   and browsers, curl and systemd's resolver map `*.localhost` to loopback with no DNS set-up
   (RFC 6761). Any client could already reach the same sandbox by headers or path.
3. Path `/proxy/{id}/{port}/...`: for clients that can set neither headers nor the host. The
   prefix is removed before forwarding.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

from starlette.types import Scope

SANDBOX_ID_HEADER = "E2b-Sandbox-Id"
SANDBOX_PORT_HEADER = "E2b-Sandbox-Port"
PATH_PREFIX = "/proxy/"
LOOPBACK_DOMAIN = "localhost"

_ID_HEADER = SANDBOX_ID_HEADER.lower().encode()
_PORT_HEADER = SANDBOX_PORT_HEADER.lower().encode()
# Sandbox ids are `[a-z0-9]{20}` (DESIGN.md); any length is accepted as infra does, but never a
# dash: host routing splits on it.
_SANDBOX_ID = re.compile(r"[a-z0-9]+")
_PORT = re.compile(r"[0-9]{1,5}")


@dataclass(frozen=True, slots=True)
class Target:
    """A request addressed to `port` of sandbox `sandbox_id`; `path`/`raw_path` are what the
    sandbox must see (the `/proxy/...` prefix removed)."""

    sandbox_id: str
    port: int
    path: str
    raw_path: bytes


class RoutingError(Exception):
    """The request is addressed to a sandbox, but malformed; answered with 400."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def route(scope: Scope, domain: str | None) -> Target | None:
    """Classify an HTTP or WebSocket scope: a `Target` for data-plane traffic, `None` for the
    control plane. Raises `RoutingError` when the request names a sandbox badly. `domain` is
    the sandbox domain for host routing (`None`: only `LOOPBACK_DOMAIN`)."""
    sandbox_id: bytes | None = None
    port: bytes | None = None
    host: bytes | None = None
    for name, value in scope["headers"]:
        if name == _ID_HEADER:
            sandbox_id = sandbox_id or value
        elif name == _PORT_HEADER:
            port = port or value
        elif name == b"host":
            host = host or value
    path: str = scope["path"]
    raw_path: bytes = scope.get("raw_path") or path.encode()
    if sandbox_id or port:
        # Empty values count as absent, as Go's Header.Get does in infra.
        if not sandbox_id:
            raise RoutingError(f"Missing header: {SANDBOX_ID_HEADER}")
        if not port:
            raise RoutingError(f"Missing header: {SANDBOX_PORT_HEADER}")
        sandbox_id_text = sandbox_id.decode("latin-1").strip()
        return _target(sandbox_id_text, port.decode("latin-1").strip(), path, raw_path)
    if host is not None:
        for suffix in (domain, LOOPBACK_DOMAIN):
            target = _from_host(host.decode("latin-1"), suffix, path, raw_path) if suffix else None
            if target is not None:
                return target
    if path.startswith(PATH_PREFIX):
        return _from_path(raw_path)
    return None


def _from_host(host: str, domain: str, path: str, raw_path: bytes) -> Target | None:
    hostname = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    hostname = hostname.lower().rstrip(".")
    # The domain may carry a port (E2B_DOMAIN=example.test:8443); the Host's port is dropped.
    suffix = "." + domain.split(":", 1)[0].lower().rstrip(".")
    if not hostname.endswith(suffix):
        return None
    label = hostname[: -len(suffix)].split(".", 1)[0]
    port, dash, sandbox_id = label.partition("-")
    # `api.{domain}` and other names without a `{port}-` label belong to the control plane.
    if not dash or not port.isdigit():
        return None
    return _target(sandbox_id, port, path, raw_path)


def _from_path(raw_path: bytes) -> Target:
    # Split the raw path so percent-escapes in the rest reach the sandbox untouched.
    parts = raw_path.split(b"/", 4)
    if len(parts) < 4:
        raise RoutingError(f"Expected {PATH_PREFIX}{{sandboxId}}/{{port}}/...")
    sandbox_id = unquote_to_bytes(parts[2]).decode("latin-1")
    port = unquote_to_bytes(parts[3]).decode("latin-1")
    rest = b"/" + parts[4] if len(parts) == 5 else b"/"
    return _target(sandbox_id, port, unquote_to_bytes(rest).decode("utf-8", "replace"), rest)


def _target(sandbox_id: str, port: str, path: str, raw_path: bytes) -> Target:
    if not _SANDBOX_ID.fullmatch(sandbox_id):
        raise RoutingError("Invalid sandbox ID")
    if not _PORT.fullmatch(port) or not 0 < int(port) < 65536:
        raise RoutingError("Invalid sandbox port")
    return Target(sandbox_id, int(port), path, raw_path)
